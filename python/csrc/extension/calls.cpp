// graphed._torch_ext: the calls that make graphed callables and steps,
// replay them, and report on them (stats, memory, the library and the
// driver).
#include "extension.h"

namespace graphed_ext {

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

}  // namespace graphed_ext
