// The Python extension graphed._torch_ext: the C++ adapter (graphed_torch.h)
// for Python callables. graphed/torch/_make.py prepares the callables
// (argument flattening, hooks, Transformer Engine's options) and calls
// make(); replays go through GraphedCallable.replay. Python callables are
// called from graphed's callbacks with the GIL taken, on whichever thread
// runs them.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Generator.h>
#include <torch/extension.h>
#include <torch/headeronly/version.h>

#include <pybind11/stl.h>

#include <dlfcn.h>
#include <graphed.hpp>

#include <optional>

#include "graphed_torch.h"

namespace py = pybind11;

namespace {

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

template <class T>
T get(const py::dict& d, const char* key, T fallback) {
    return d.contains(key) && !d[key].is_none() ? d[key].cast<T>() : fallback;
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

// One tuple of sample inputs per callable. Returns, per callable, its graphs
// for every microbatch: result[callable][microbatch].
py::list make(py::list specs, py::dict options) {
    std::vector<graphed_torch::CallableSpec> v;
    for (py::handle h : specs) v.push_back(spec_of(h.cast<py::dict>()));
    graphed_torch::Options o = options_of(options);
    std::vector<graphed_torch::GraphedCallable> out;
    {
        // Warmup and capture call back into Python, which takes the GIL
        // itself; the autograd engine's threads may need it too.
        py::gil_scoped_release nogil;
        out = graphed_torch::make_graphed_callables(std::move(v), o);
    }
    py::list result;
    for (auto& g : out) {
        py::list per_microbatch;
        for (uint32_t m = 0; m < g.microbatches(); ++m) per_microbatch.append(py::cast(g.for_microbatch(m)));
        result.append(per_microbatch);
    }
    return result;
}

// make() for a step (graphed_torch::make_graphed_step): returns (per
// callable its graphs for microbatch 0, the step). `step` holds
// microbatches, loop and destination (a function of a parameter returning
// the tensor its grad is added into, called once per parameter here).
py::tuple make_step(py::list specs, py::dict options, py::dict step) {
    std::vector<graphed_torch::CallableSpec> v;
    for (py::handle h : specs) v.push_back(spec_of(h.cast<py::dict>()));
    graphed_torch::Options o = options_of(options);
    graphed_torch::StepOptions so;
    so.microbatches = get<uint32_t>(step, "microbatches", 1);
    so.loop = get<bool>(step, "loop", false);
    auto dst = hold(step["destination"]);
    so.destination = [dst](const at::Tensor& p) -> at::Tensor {
        py::gil_scoped_acquire gil;
        py::object d = (*dst)(py::reinterpret_steal<py::object>(THPVariable_Wrap(p)));
        return d.is_none() ? at::Tensor() : tensor_of(d, "the step's grad destination");
    };
    // The update stage: Python functions of (slot, grads, scalars, skip_flag).
    auto update = [](const py::dict& d, const char* key) -> std::function<void(const graphed_torch::StepUpdateView&)> {
        if (!d.contains(key) || d[key].is_none()) return {};
        auto fn = hold(d[key]);
        return [fn](const graphed_torch::StepUpdateView& v) {
            py::gil_scoped_acquire gil;
            py::list grads;
            for (const at::Tensor& g : v.grads)
                grads.append(g.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(g)) : py::none());
            auto wrap = [](const at::Tensor& t) {
                return t.defined() ? py::reinterpret_steal<py::object>(THPVariable_Wrap(t)) : py::object(py::none());
            };
            (*fn)(v.slot, grads, wrap(v.scalars), wrap(v.skip_flag));
        };
    };
    so.update_check = update(step, "update_check");
    so.update_apply = update(step, "update_apply");
    so.scalar_bytes = get<size_t>(step, "scalar_bytes", 0);
    if (step.contains("loss_seed") && !step["loss_seed"].is_none())
        so.loss_seed = tensor_of(step["loss_seed"], "the step's loss seed");
    std::optional<std::pair<std::vector<graphed_torch::GraphedCallable>, graphed_torch::GraphedStep>> out;
    {
        py::gil_scoped_release nogil;
        out.emplace(graphed_torch::make_graphed_step(std::move(v), o, so));
    }
    py::list callables;
    for (auto& g : out->first) callables.append(py::cast(g));
    return py::make_tuple(callables, py::cast(out->second));
}

py::list replay(const graphed_torch::GraphedCallable& g, py::sequence inputs, py::object stream, py::object event) {
    std::vector<at::Tensor> ins;
    ins.reserve(py::len(inputs));
    size_t i = 0;
    for (py::handle h : inputs) {
        if (!THPVariable_Check(h.ptr()))
            throw py::type_error("graphed callable: " + g.input_name(i) + " must be a tensor, not " +
                                 std::string(py::str(py::type::handle_of(h).attr("__name__"))));
        ins.push_back(THPVariable_Unpack(h.ptr()));
        ++i;
    }
    graphed_torch::ReplayOn on;
    if (!stream.is_none()) {
        auto [ptr, device] = stream.cast<std::pair<uintptr_t, int>>();
        on.stream = c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(ptr), c10::DeviceIndex(device));
    }
    if (!event.is_none()) on.join_event = reinterpret_cast<cudaEvent_t>(event.cast<uintptr_t>());
    // Accumulated grads: the attribute of each parameter, read now (the GIL
    // is held for the whole call); `grad` is created as zeros where it is
    // None, as AccumulateGrad would create it.
    if (!g.accumulate_into().empty())
        on.accumulate_dst = [&g](const at::Tensor& p) -> at::Tensor {
            const std::string& attr = g.accumulate_into();
            py::object param = py::reinterpret_steal<py::object>(THPVariable_Wrap(p));
            py::object d = py::getattr(param, attr.c_str(), py::none());
            if (d.is_none() && attr == "grad") {
                py::object zeros = py::reinterpret_steal<py::object>(
                    THPVariable_Wrap(at::zeros_like(p, at::MemoryFormat::Contiguous)));
                py::setattr(param, "grad", zeros);
                d = zeros;
            }
            if (d.is_none()) return at::Tensor();
            if (!THPVariable_Check(d.ptr()))
                throw py::type_error("graphed: parameter ." + attr + " must be a tensor, not " +
                                     std::string(py::str(py::type::handle_of(d).attr("__name__"))));
            return THPVariable_Unpack(d.ptr());
        };
    std::vector<at::Tensor> outs = g(ins, on);
    py::list l;
    for (at::Tensor& t : outs) l.append(py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))));
    return l;
}

py::dict stats_of(const graphed_torch::GraphedCallable& g) {
    graphed_session_stats st = g.stats();
    py::dict d;
    d["static_bytes"] = st.static_bytes;
    d["static_bytes_without_reuse"] = st.static_bytes_without_reuse;
    d["peak_live_bytes"] = st.peak_live_bytes;
    d["scratch_bytes"] = st.scratch_bytes;
    d["clone_bytes_outstanding"] = st.clone_bytes_outstanding;
    d["clone_blocks_outstanding"] = st.clone_blocks_outstanding;
    d["leases_held"] = st.leases_held;
    d["graph_count"] = st.graph_count;
    d["microbatches"] = st.microbatches;
    d["captured"] = bool(st.captured);
    d["inputs_rebound"] = st.inputs_rebound;
    d["inputs_rebind_refused"] = st.inputs_rebind_refused;
    d["rebind_nodes"] = st.rebind_nodes;
    d["slot_graphs"] = st.slot_graphs;
    d["step_graphs"] = st.step_graphs;
    // Owned grads in fresh memory (Options::lazy_clones): whether in force;
    // the grads written straight there, and those capture refused (copied).
    d["lazy_clones"] = g.lazy_clones();
    d["grads_in_place"] = st.grads_in_place;
    d["grads_in_place_refused"] = st.grads_in_place_refused;
    d["capture_ns"] = st.capture_ns;
    d["capture_plan_ns"] = st.capture_plan_ns;
    d["capture_warmup_ns"] = st.capture_warmup_ns;
    d["capture_record_ns"] = st.capture_record_ns;
    d["capture_instantiate_ns"] = st.capture_instantiate_ns;
    d["capture_upload_ns"] = st.capture_upload_ns;
    d["capture_slots_ns"] = st.capture_slots_ns;
    d["capture_steps_ns"] = st.capture_steps_ns;
    d["capture_rebind_plan_ns"] = st.capture_rebind_plan_ns;
    d["capture_rebind_verify_ns"] = st.capture_rebind_verify_ns;
    d["teardown_errors"] = st.teardown_errors;
    d["templates_kept"] = st.templates_kept;
    d["params_movable"] = st.params_movable;
    d["params_move_refused"] = st.params_move_refused;
    d["param_moves"] = st.param_moves;
    return d;
}

// graphed_torch::memory_report() as plain Python data.
py::dict memory_report() {
    // Without the GIL: a reset on another thread holds a session's lock
    // while letting go of Python objects, which takes the GIL.
    graphed_torch::MemoryReport r;
    {
        py::gil_scoped_release nogil;
        r = graphed_torch::memory_report();
    }
    py::list sessions;
    uint64_t torch_bytes = 0;
    for (const graphed_torch::SessionMemory& s : r.sessions) {
        py::list callables;
        for (const graphed_torch::CallableMemory& c : s.callables) {
            py::dict d;
            d["name"] = c.name;
            d["released"] = c.released;
            d["own_static_bytes"] = c.own_static_bytes;
            d["shared_static_bytes"] = c.shared_static_bytes;
            d["graphs"] = c.graphs;
            d["step_graphs"] = c.step_graphs;
            d["clone_bytes_outstanding"] = c.clone_bytes_outstanding;
            d["clone_bytes_cached"] = c.clone_bytes_cached;
            d["torch_bytes"] = c.torch_bytes;
            torch_bytes += c.torch_bytes;
            callables.append(d);
        }
        py::dict d;
        d["reset"] = s.reset;
        d["busy"] = s.busy;
        d["callables"] = callables;
        d["static_bytes"] = s.static_bytes;
        d["scratch_bytes"] = s.scratch_bytes;
        d["pool_bytes"] = s.pool_bytes;
        d["graphs"] = s.graphs;
        d["torch_pool_reserved"] = s.torch_pool_reserved;
        d["torch_pool_allocated"] = s.torch_pool_allocated;
        sessions.append(d);
    }
    py::dict d;
    d["sessions"] = sessions;
    d["total_bytes"] = r.graphed.device_bytes;
    d["allocations"] = r.graphed.allocations;
    d["live_sessions"] = r.graphed.sessions;
    d["graphs"] = r.graphed.graphs;
    d["torch_bytes"] = torch_bytes;
    return d;
}

std::string library_path() {
    Dl_info info;
    if (dladdr(reinterpret_cast<void*>(&graphed_version), &info) && info.dli_fname) return info.dli_fname;
    return "";
}

// The driver as graphed sees it; a failure (no driver, no device) is
// reported, not raised: the status and message of the last failing query.
py::dict driver() {
    py::dict d;
    std::optional<graphed::Error> failed;
    try {
        d["driver_cuda_version"] = graphed::driver_version();
    } catch (const graphed::Error& e) {
        d["driver_cuda_version"] = py::none();
        failed = e;
    }
    try {
        d["device_count"] = graphed::device_count();
    } catch (const graphed::Error& e) {
        d["device_count"] = 0u;
        failed = e;
    }
    d["status"] = graphed::status_name(failed ? failed->status() : GRAPHED_STATUS_OK);
    d["message"] = failed ? failed->message() : std::string();
    return d;
}

}  // namespace

PYBIND11_MODULE(_torch_ext, m) {
    m.doc() = "graphed for PyTorch: the C++ adapter over graphed's C API (use graphed.torch)";
    if (graphed_torch::library_version() != graphed_torch::header_version())
        throw py::import_error("graphed: the loaded libgraphed.so is version " + graphed_torch::library_version() +
                               " (" + library_path() + ") but this extension was built against the header of " +
                               graphed_torch::header_version() + "; reinstall the package");

    static py::object alias_held = py::module_::import("graphed.torch._errors").attr("AliasHeldError");
    static py::object param_moved = py::module_::import("graphed.torch._errors").attr("ParamMovedError");
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const graphed_torch::AliasHeld& e) {
            PyErr_SetString(alias_held.ptr(), e.what());
        } catch (const graphed_torch::ParamMoved& e) {
            PyErr_SetString(param_moved.ptr(), e.what());
        }
    });

    py::class_<graphed_torch::GraphedCallable>(m, "GraphedCallable")
        .def("replay", &replay, py::arg("inputs"), py::arg("stream") = py::none(), py::arg("event") = py::none())
        .def("backward_dw", &graphed_torch::GraphedCallable::backward_dw, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("has_backward_dw", &graphed_torch::GraphedCallable::has_backward_dw)
        .def("reset", &graphed_torch::GraphedCallable::reset, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("is_reset", &graphed_torch::GraphedCallable::is_reset)
        .def("release", &graphed_torch::GraphedCallable::release, py::call_guard<py::gil_scoped_release>())
        .def_property_readonly("is_released", &graphed_torch::GraphedCallable::is_released)
        .def_property_readonly("microbatches", &graphed_torch::GraphedCallable::microbatches)
        .def_property_readonly("bucket_sizes", &graphed_torch::GraphedCallable::bucket_sizes)
        .def_property_readonly("bucket_sizes2", &graphed_torch::GraphedCallable::bucket_sizes2)
        .def("session_stats", &stats_of)
        .def("session_plan", &graphed_torch::GraphedCallable::plan)
        .def("export_dot", &graphed_torch::GraphedCallable::export_dot)
        .def("params_movable", &graphed_torch::GraphedCallable::params_movable);
    graphed_torch::set_failure_site(&python_site);
    m.def("make", &make, py::arg("specs"), py::arg("options"));
    // What a capture error says broke a callback (graphed_torch's
    // failure_report): `fn` runs under the same watch of torch operators.
    m.def(
        "_failure_report",
        [](const py::function& fn) { return graphed_torch::failure_report([&] { fn(); }); },
        py::arg("fn"));
    m.def("default_options", &default_options,
          "graphed_torch::Options' defaults of make_graphed_callables' keyword options, by keyword.");
    m.def("export_dot", &graphed_torch::export_dot,
          "Every live session's captured graphs as Graphviz DOT text, one digraph per session.");
    m.def("memory_report", &memory_report,
          "What graphed holds: per live session and callable, and graphed's process-wide accounting.");
    py::class_<graphed_torch::GraphedStep>(m, "GraphedStep")
        .def(
            "replay",
            [](const graphed_torch::GraphedStep& st, py::sequence data, uint32_t n, py::object scalars) {
                std::vector<at::Tensor> v = tensors_of(data, "data");
                if (scalars.is_none()) return st(v, n);
                // The update's scalars for this replay: bytes, read before the call returns.
                char* buf = nullptr;
                Py_ssize_t len = 0;
                if (PyBytes_AsStringAndSize(scalars.ptr(), &buf, &len) != 0) throw py::error_already_set();
                return st(v, n, buf, size_t(len));
            },
            py::arg("data"), py::arg("n") = 0, py::arg("scalars") = py::none())
        .def("skipped",
             [](const graphed_torch::GraphedStep& st) {
                 graphed_torch::StepSkipped k;
                 {
                     py::gil_scoped_release nogil;
                     k = st.skipped();
                 }
                 return py::make_tuple(k.last, k.total);
             })
        .def_property_readonly("destinations", &graphed_torch::GraphedStep::destinations)
        .def_property_readonly("microbatches", &graphed_torch::GraphedStep::microbatches);
    m.def("make_step", &make_step, py::arg("specs"), py::arg("options"), py::arg("step"));
    m.def(
        "storage_use_count", [](const at::Tensor& t) { return t.storage().use_count(); },
        "How many tensors (and other holders) share t's storage.");
    m.def(
        "pass_order",
        [](size_t n, const std::vector<std::pair<uint32_t, uint32_t>>& steps, const std::vector<uint32_t>& layers) {
            std::vector<std::tuple<uint32_t, uint32_t, uint32_t>> v;
            for (auto& p : graphed_torch::pass_order(n, steps_of(steps), layers))
                v.emplace_back(p.callable, p.microbatch, uint32_t(p.pass));
            return v;
        },
        "The passes of one iteration in capture order: (callable, microbatch, pass).");
    m.def("schedule", &schedule, py::arg("order"), py::arg("layers_per_chunk"), py::arg("num_callables"),
          "Transformer Engine's _order as graphed reads it: steps, microbatches, layers_per_chunk, chunk_first.");
    m.def(
        "reuse_releases",
        [](size_t n, const std::vector<std::pair<uint32_t, uint32_t>>& steps, const std::vector<uint32_t>& layers) {
            std::vector<std::vector<std::tuple<uint32_t, uint32_t, uint32_t>>> v;
            for (auto& rs : graphed_torch::reuse_releases(n, steps_of(steps), layers)) {
                v.emplace_back();
                for (auto& r : rs) v.back().emplace_back(r.callable, r.microbatch, r.role);
            }
            return v;
        },
        "With buffer reuse: what each captured pass lets go of, as graphed says (graphed_schedule_releases): "
        "(callable, microbatch, graphed_buffer_role).");
    // graphed's constants the package passes or receives, from the header.
    m.attr("PASS_FORWARD") = uint32_t(GRAPHED_PASS_FORWARD);
    m.attr("PASS_BACKWARD") = uint32_t(GRAPHED_PASS_BACKWARD);
    m.attr("PASS_WGRAD") = uint32_t(GRAPHED_PASS_WGRAD);
    m.attr("PARAM_FLAGS_DELAYED_WGRAD") = uint32_t(GRAPHED_PARAM_FLAGS_DELAYED_WGRAD);
    m.attr("PARAM_FLAGS_REBIND") = uint32_t(GRAPHED_PARAM_FLAGS_REBIND);
    m.attr("BUFFER_ROLE_OUTPUT") = uint32_t(GRAPHED_BUFFER_ROLE_OUTPUT);
    m.attr("BUFFER_ROLE_GRAD_INPUT") = uint32_t(GRAPHED_BUFFER_ROLE_GRAD_INPUT);
    m.attr("BUFFER_ROLE_PARAM_GRADS") = uint32_t(GRAPHED_BUFFER_ROLE_PARAM_GRADS);
    m.def("built_with_torch", [] {
        return std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + "." +
               std::to_string(TORCH_VERSION_PATCH);
    });
    m.def("library_version", &graphed_torch::library_version);
    m.def("header_version", &graphed_torch::header_version);
    m.def("library_path", &library_path);
    m.def("driver", &driver);
}
