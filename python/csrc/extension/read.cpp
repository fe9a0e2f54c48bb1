// graphed._torch_ext: reading what graphed/torch/*.py passes — tensors,
// callable specs, parameter slots, callbacks, options and their defaults,
// Transformer Engine's schedule order — into graphed_torch's types.
#include "extension.h"

namespace graphed_ext {

// Where the Python code that raised `e` issued it (graphed_torch's
// FailureSite): the traceback's last frame outside torch and graphed, as
// graphed.torch._errors.failure_site writes it; "" for an exception that
// did not come through Python (or a traceback that cannot be read).
std::string python_site(const std::exception_ptr& e) {
    py::gil_scoped_acquire gil;
    try {
        py::object tb;
        try {
            std::rethrow_exception(e);
        } catch (py::error_already_set& err) {
            tb = err.trace();
        } catch (python_error& err) {
            if (err.traceback) tb = py::reinterpret_borrow<py::object>(err.traceback);
        } catch (...) {
        }
        if (!tb || tb.is_none()) return "";
        return py::module_::import("graphed.torch._errors").attr("failure_site")(tb).cast<std::string>();
    } catch (py::error_already_set& err) {
        err.discard_as_unraisable("graphed: reading the traceback of a failed callback");
        return "";
    }
}

// A Python object that may be released on any thread: the GIL is taken then.
std::shared_ptr<py::object> hold(py::object o) {
    return std::shared_ptr<py::object>(new py::object(std::move(o)), [](py::object* p) {
        py::gil_scoped_acquire gil;
        delete p;
    });
}

at::Tensor tensor_of(py::handle h, const std::string& what) {
    if (!THPVariable_Check(h.ptr()))
        throw py::type_error(what + " must be a tensor, not " + std::string(py::str(py::type::handle_of(h).attr("__name__"))));
    return THPVariable_Unpack(h.ptr());
}

std::vector<at::Tensor> tensors_of(py::handle seq, const std::string& what) {
    std::vector<at::Tensor> v;
    size_t i = 0;
    for (py::handle h : seq) v.push_back(tensor_of(h, what + "[" + std::to_string(i++) + "]"));
    return v;
}

py::object list_or_none(const std::vector<at::Tensor>* v) {
    if (!v) return py::none();
    py::list l;
    for (const at::Tensor& t : *v) l.append(t.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(t)) : py::none());
    return std::move(l);
}

// Where a module's parameters are now: per parameter, the `_parameters`
// dict of the module that owns it and its key there, looked up at every
// call with the dict API (no Python code runs), so that a Parameter
// replaced there (load_state_dict(assign=True), an optimizer, a swap) is
// the one the graphs read and autograd gives the grad to.
graphed_torch::ParamSource param_source_of(py::handle slots, const std::string& callable,
                                           const std::vector<std::string>& names) {
    struct Slot {
        py::object dict, key;
    };
    auto held = std::shared_ptr<std::vector<Slot>>(new std::vector<Slot>(), [](std::vector<Slot>* v) {
        py::gil_scoped_acquire gil;
        delete v;
    });
    // A None slot: the tensor registered stays that parameter.
    for (py::handle h : slots) {
        if (h.is_none()) {
            held->push_back(Slot{});
            continue;
        }
        auto t = h.cast<py::tuple>();
        if (t.size() != 2 || !PyDict_Check(t[0].ptr()))
            throw py::type_error("param_slots: (module._parameters, key) pairs or None expected");
        held->push_back(Slot{py::reinterpret_borrow<py::object>(t[0]), py::reinterpret_borrow<py::object>(t[1])});
    }
    auto lookup = [held, callable, names](std::vector<at::Tensor>& params) {
        const std::vector<Slot>& v = *held;
        for (size_t j = 0; j < v.size() && j < params.size(); ++j) {
            if (!v[j].dict) continue;
            PyObject* o = PyDict_GetItem(v[j].dict.ptr(), v[j].key.ptr());  // borrowed
            if (!o || !THPVariable_Check(o)) {
                const std::string name = j < names.size() ? names[j] : "parameter " + std::to_string(j);
                throw graphed_torch::ParamMoved(
                    "graphed callable '" + callable + "': parameter '" + name + "' is " +
                    (o ? "now " + std::string(py::str(py::type::handle_of(o).attr("__name__"))) + ", not a tensor"
                       : std::string("no longer registered in its module")) +
                    "; its graphs read it. Register a tensor of the captured shape, dtype and device under that "
                    "name, or reset() the graphs and make them again.");
            }
            const at::Tensor& t = THPVariable_Unpack(o);
            if (!t.is_same(params[j])) params[j] = t;
        }
    };
    return [lookup](std::vector<at::Tensor>& params) {
        // Replays are called from Python, with the GIL held.
        if (PyGILState_Check()) return lookup(params);
        py::gil_scoped_acquire gil;
        lookup(params);
    };
}

graphed_torch::CallableSpec spec_of(const py::dict& d) {
    graphed_torch::CallableSpec s;
    s.name = d["name"].cast<std::string>();
    auto fwd = hold(d["forward"]);
    s.forward = [fwd](const std::vector<at::Tensor>& ins) {
        py::gil_scoped_acquire gil;
        py::list args;
        for (const at::Tensor& t : ins) args.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)));
        return tensors_of((*fwd)(args), "output");
    };
    s.sample_inputs = tensors_of(d["samples"], "sample");
    s.input_names = get<std::vector<std::string>>(d, "input_names", {});
    s.params = tensors_of(d["params"], "parameter");
    s.param_names = get<std::vector<std::string>>(d, "param_names", {});
    s.param_flags = get<std::vector<uint32_t>>(d, "param_flags", {});
    s.bucket_sizes = get<std::vector<int64_t>>(d, "bucket_sizes", {});
    s.dynamic_inputs = get<std::vector<bool>>(d, "dynamic_inputs", {});
    s.bucket_sizes2 = get<std::vector<int64_t>>(d, "bucket_sizes2", {});
    s.dynamic_dims = get<std::vector<int64_t>>(d, "dynamic_dims", {});
    s.dynamic_dims2 = get<std::vector<int64_t>>(d, "dynamic_dims2", {});
    if (d.contains("param_slots") && !d["param_slots"].is_none())
        s.param_source = param_source_of(d["param_slots"], s.name, s.param_names);
    if (d.contains("hook") && !d["hook"].is_none()) {
        auto hook = hold(d["hook"]);
        s.hook = [hook](const graphed_torch::HookEvent& e) {
            py::gil_scoped_acquire gil;
            (*hook)(e.before, uint32_t(e.pass), e.capture, e.microbatch, list_or_none(e.inputs), list_or_none(e.outputs),
                    list_or_none(e.grad_outputs), list_or_none(e.grads));
        };
    }
    return s;
}

std::function<void()> callback_of(const py::dict& d, const char* key) {
    if (!d.contains(key) || d[key].is_none()) return {};
    auto fn = hold(d[key]);
    return [fn] {
        py::gil_scoped_acquire gil;
        (*fn)();
    };
}

std::vector<graphed_schedule_step> steps_of(const std::vector<std::pair<uint32_t, uint32_t>>& steps) {
    std::vector<graphed_schedule_step> v;
    for (auto [pass, chunk] : steps) v.push_back({pass, chunk});
    return v;
}

// Options the package passes by name, with graphed_torch::Options' own
// defaults where a key is missing (the defaults are declared there once;
// make_graphed_callables' keyword defaults are checked against
// default_options() by test_options.py).
graphed_torch::Options options_of(const py::dict& d) {
    graphed_torch::Options o;
    o.num_warmup_iters = get<int>(d, "num_warmup_iters", o.num_warmup_iters);
    o.training = get<bool>(d, "training", o.training);
    o.allow_unused_input = get<bool>(d, "allow_unused_input", o.allow_unused_input);
    o.retain_graph_in_backward = get<bool>(d, "retain_graph_in_backward", o.retain_graph_in_backward);
    o.clone_param_grads_on_return = get<bool>(d, "clone_param_grads_on_return", o.clone_param_grads_on_return);
    o.clones_from_torch_allocator = get<bool>(d, "clones_from_torch_allocator", o.clones_from_torch_allocator);
    o.lazy_clones = get<bool>(d, "lazy_clones", o.lazy_clones);
    o.strict_leases = get<bool>(d, "strict_leases", o.strict_leases);
    o.debug = get<bool>(d, "debug", o.debug);
    o.rebind_inputs = get<bool>(d, "rebind_inputs", o.rebind_inputs);
    o.rebind_params = get<bool>(d, "rebind_params", o.rebind_params);
    o.schedule = steps_of(get<std::vector<std::pair<uint32_t, uint32_t>>>(d, "steps", {}));
    o.layers_per_chunk = get<std::vector<uint32_t>>(d, "layers_per_chunk", {});
    o.reuse_buffers = get<bool>(d, "reuse_buffers", o.reuse_buffers);
    if (d.contains("accumulate_into") && !d["accumulate_into"].is_none())
        o.accumulate_into = d["accumulate_into"].cast<std::string>();
    o.copy_into = get<bool>(d, "copy_into", o.copy_into);
    if (d.contains("pool") && !d["pool"].is_none()) {
        auto p = d["pool"].cast<std::pair<unsigned long long, unsigned long long>>();
        o.pool = c10::MempoolId_t{p.first, p.second};
    }
    if (d.contains("capture_stream") && !d["capture_stream"].is_none()) {
        auto [ptr, device] = d["capture_stream"].cast<std::pair<uintptr_t, int>>();
        o.capture_stream = c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(ptr), c10::DeviceIndex(device));
    }
    if (d.contains("generators"))
        for (py::handle g : d["generators"]) {
            if (!THPGenerator_Check(g.ptr())) throw py::type_error("generators must be torch.Generator objects");
            o.generators.push_back(reinterpret_cast<THPGenerator*>(g.ptr())->cdata);
        }
    o.pre_warmup_hook = callback_of(d, "pre_warmup_hook");
    o.post_warmup_hook = callback_of(d, "post_warmup_hook");
    return o;
}

// graphed_torch::Options' defaults of the options make_graphed_callables
// takes as keywords, by their keyword's name.
py::dict default_options() {
    const graphed_torch::Options o;
    py::dict d;
    d["num_warmup_iters"] = o.num_warmup_iters;
    d["allow_unused_input"] = o.allow_unused_input;
    d["retain_graph_in_backward"] = o.retain_graph_in_backward;
    d["clone_param_grads_on_return"] = o.clone_param_grads_on_return;
    d["clones_from_torch_allocator"] = o.clones_from_torch_allocator;
    d["lazy_clones"] = o.lazy_clones;
    d["strict_leases"] = o.strict_leases;
    d["debug"] = o.debug;
    d["rebind_inputs"] = o.rebind_inputs;
    d["rebind_params"] = o.rebind_params;
    d["_reuse_graph_input_output_buffers"] = o.reuse_buffers;
    return d;
}

// Transformer Engine's `_order` as graphed reads it for `num_callables`
// callables (graphed_torch::schedule_from_te_order): its steps as (pass,
// chunk) pairs, microbatches, layers per chunk and each chunk's first
// callable. A schedule that breaks one of graphed's rules raises ValueError
// with graphed's message.
py::dict schedule(const std::vector<double>& order, const std::vector<int64_t>& layers_per_chunk,
                  size_t num_callables) {
    std::vector<uint32_t> layers;
    for (size_t i = 0; i < layers_per_chunk.size(); ++i) {
        const int64_t n = layers_per_chunk[i];
        if (n < 0 || n > int64_t(UINT32_MAX))
            throw py::value_error("layers_per_chunk[" + std::to_string(i) + "] is " + std::to_string(n) +
                                  ": not a number of layers");
        layers.push_back(uint32_t(n));
    }
    graphed_torch::Schedule s = graphed_torch::schedule_from_te_order(order, num_callables, layers);
    py::list steps;
    for (const graphed_schedule_step& st : s.steps) steps.append(py::make_tuple(st.pass, st.chunk));
    py::dict d;
    d["steps"] = steps;
    d["microbatches"] = s.microbatches;
    d["layers_per_chunk"] = s.layers_per_chunk;
    d["chunk_first"] = s.chunk_first;
    return d;
}

}  // namespace graphed_ext
