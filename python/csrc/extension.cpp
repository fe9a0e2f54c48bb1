// The Python extension graphed._torch_ext: the C++ adapter (graphed_torch.h)
// for Python callables. graphed/torch/_make.py prepares the callables
// (argument flattening, hooks, Transformer Engine's options) and calls
// make(); replays go through GraphedCallable.replay. Python callables are
// called from graphed's callbacks with the GIL taken, on whichever thread
// runs them.
// This file defines the module; its functions are in extension/.
#include "extension/extension.h"

using namespace graphed_ext;

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
