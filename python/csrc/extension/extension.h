// The Python extension's own declarations (graphed._torch_ext), shared by
// its files: reading what graphed/torch/*.py passes (read.cpp), the calls
// that make and replay graphs and report on them (calls.cpp), and the
// module's definition (../extension.cpp).
#pragma once

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

namespace graphed_ext {

// Reading what Python passes (read.cpp).
std::string python_site(const std::exception_ptr& e);
std::shared_ptr<py::object> hold(py::object o);
at::Tensor tensor_of(py::handle h, const std::string& what);
std::vector<at::Tensor> tensors_of(py::handle seq, const std::string& what);
py::object list_or_none(const std::vector<at::Tensor>* v);
graphed_torch::ParamSource param_source_of(py::handle slots, const std::string& callable,
                                           const std::vector<std::string>& names);
graphed_torch::CallableSpec spec_of(const py::dict& d);
std::function<void()> callback_of(const py::dict& d, const char* key);
std::vector<graphed_schedule_step> steps_of(const std::vector<std::pair<uint32_t, uint32_t>>& steps);
graphed_torch::Options options_of(const py::dict& d);
py::dict default_options();
py::dict schedule(const std::vector<double>& order, const std::vector<int64_t>& layers_per_chunk,
                  size_t num_callables);

// Making, replaying and reporting (calls.cpp).
py::list make(py::list specs, py::dict options);
py::tuple make_step(py::list specs, py::dict options, py::dict step);
py::list replay(const graphed_torch::GraphedCallable& g, py::sequence inputs, py::object stream, py::object event);
py::dict stats_of(const graphed_torch::GraphedCallable& g);
py::dict memory_report();
std::string library_path();
py::dict driver();

template <class T>
T get(const py::dict& d, const char* key, T fallback) {
    return d.contains(key) && !d[key].is_none() ? d[key].cast<T>() : fallback;
}

}  // namespace graphed_ext
