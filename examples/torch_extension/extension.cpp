// The PyTorch C++ extension: graphed's make_graphed_callables for Python
// modules (or any callables of tensors). Built with
// torch.utils.cpp_extension against libgraphed.so (see graphed_torch.py).
#include <torch/extension.h>

#include <pybind11/stl.h>

#include "graphed_torch.h"

namespace py = pybind11;

namespace {

std::vector<at::Tensor> flatten(const py::handle& out) {
    if (THPVariable_Check(out.ptr())) return {py::cast<at::Tensor>(out)};
    std::vector<at::Tensor> v;
    if (py::isinstance<py::tuple>(out) || py::isinstance<py::list>(out)) {
        for (py::handle h : out) {
            if (!THPVariable_Check(h.ptr())) throw std::runtime_error("graphed callables must return tensors");
            v.push_back(py::cast<at::Tensor>(h));
        }
        return v;
    }
    throw std::runtime_error("graphed callables must return a tensor or a tuple of tensors");
}

// One tuple of sample args per callable. With a schedule (`steps`, in
// graphed's {pass, chunk} form, converted from Transformer Engine's _order
// by graphed_torch.py), the callables are the layers and the result lists
// each layer's graphs for every microbatch: result[callable][microbatch].
py::list make_graphed_callables(py::sequence callables, py::sequence sample_args, int num_warmup_iters,
                                bool clone_param_grads_on_return, bool clones_from_torch_allocator,
                                std::vector<std::pair<uint32_t, uint32_t>> steps, std::vector<uint32_t> layers_per_chunk,
                                bool reuse_buffers) {
    if (py::len(callables) != py::len(sample_args))
        throw std::runtime_error("make_graphed_callables: one tuple of sample args per callable");
    std::vector<graphed_torch::CallableSpec> specs;
    py::object module_type = py::module_::import("torch.nn").attr("Module");
    for (size_t i = 0; i < py::len(callables); ++i) {
        py::object fn = callables[i];
        graphed_torch::CallableSpec s;
        s.name = py::isinstance(fn, module_type) ? std::string(py::str(fn.attr("__class__").attr("__name__"))) + "_" +
                                                       std::to_string(i)
                                                 : "callable_" + std::to_string(i);
        // The Python object is released with the GIL held, whichever thread
        // drops the last reference.
        auto holder = std::shared_ptr<py::object>(new py::object(fn), [](py::object* o) {
            py::gil_scoped_acquire gil;
            delete o;
        });
        s.forward = [holder](const std::vector<at::Tensor>& ins) {
            py::gil_scoped_acquire gil;
            py::tuple args(ins.size());
            for (size_t k = 0; k < ins.size(); ++k) args[k] = py::cast(ins[k]);
            return flatten((*holder)(*args));
        };
        for (py::handle a : py::tuple(sample_args[i])) s.sample_inputs.push_back(py::cast<at::Tensor>(a));
        if (py::isinstance(fn, module_type)) {
            for (py::handle p : fn.attr("parameters")()) {
                s.params.push_back(py::cast<at::Tensor>(p));
                // Transformer Engine's delayed weight-gradient marker.
                bool delayed = py::hasattr(p, "skip_backward_post_hook") &&
                               py::cast<bool>(py::bool_(p.attr("skip_backward_post_hook")));
                s.param_flags.push_back(delayed ? GRAPHED_PARAM_FLAGS_DELAYED_WGRAD : GRAPHED_PARAM_FLAGS_NONE);
            }
        }
        specs.push_back(std::move(s));
    }
    graphed_torch::Options o;
    o.num_warmup_iters = num_warmup_iters;
    o.clone_param_grads_on_return = clone_param_grads_on_return;
    o.clones_from_torch_allocator = clones_from_torch_allocator;
    for (auto [pass, chunk] : steps) o.schedule.push_back({pass, chunk});
    o.layers_per_chunk = std::move(layers_per_chunk);
    o.reuse_buffers = reuse_buffers;
    std::vector<graphed_torch::GraphedCallable> out;
    {
        // Capture runs the callables, which take the GIL themselves; the
        // autograd engine's threads may need it too.
        py::gil_scoped_release nogil;
        out = graphed_torch::make_graphed_callables(std::move(specs), o);
    }
    py::list result;
    for (auto& g : out) {
        py::list per_microbatch;
        for (uint32_t m = 0; m < g.microbatches(); ++m) per_microbatch.append(py::cast(g.for_microbatch(m)));
        result.append(per_microbatch);
    }
    return result;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "graphed: CUDA-graphed callables with safe gradient lifetimes";
    py::class_<graphed_torch::GraphedCallable>(m, "GraphedCallable")
        .def("__call__",
             [](const graphed_torch::GraphedCallable& g, py::args args) -> py::object {
                 std::vector<at::Tensor> ins;
                 for (py::handle a : args) ins.push_back(py::cast<at::Tensor>(a));
                 std::vector<at::Tensor> outs = g(ins);
                 if (outs.size() == 1) return py::cast(outs[0]);
                 py::tuple t(outs.size());
                 for (size_t i = 0; i < outs.size(); ++i) t[i] = py::cast(outs[i]);
                 return std::move(t);
             })
        .def_property_readonly("params", &graphed_torch::GraphedCallable::params)
        .def("session_stats", [](const graphed_torch::GraphedCallable& g) {
            graphed_session_stats st = g.stats();
            py::dict d;
            d["static_bytes"] = st.static_bytes;
            d["static_bytes_without_reuse"] = st.static_bytes_without_reuse;
            d["peak_live_bytes"] = st.peak_live_bytes;
            d["scratch_bytes"] = st.scratch_bytes;
            d["clone_bytes_outstanding"] = st.clone_bytes_outstanding;
            d["graph_count"] = st.graph_count;
            d["microbatches"] = st.microbatches;
            return d;
        });
    m.def("make_graphed_callables", &make_graphed_callables, py::arg("callables"), py::arg("sample_args"),
          py::arg("num_warmup_iters") = 3, py::arg("clone_param_grads_on_return") = true,
          py::arg("clones_from_torch_allocator") = true, py::arg("steps") = std::vector<std::pair<uint32_t, uint32_t>>{},
          py::arg("layers_per_chunk") = std::vector<uint32_t>{}, py::arg("reuse_buffers") = false);
}
