// graphed for libtorch: tensors. Each tensor's facts (Meta: shape, dtype,
// requires_grad, layout) and graphed's dtype codes; PyTorch tensors over the
// static buffers graphed's callbacks receive and over the outputs and grads
// its replays return (a CLONE grad holds its clone block, a leased ALIAS its
// lease); the fresh memory each grad pass writes owned grads into; and the
// message that names the aliases still alive when a replay would overwrite
// them (strict leases).
#include "internal.h"

#include <algorithm>
#include <cstdint>

namespace graphed_torch {

Meta meta_of(const at::Tensor& t) { return {t.sizes().vec(), t.scalar_type(), t.requires_grad()}; }

Meta layout_of(const at::Tensor& t) {
    Meta m = meta_of(t);
    if (!t.is_contiguous() && t.is_non_overlapping_and_dense()) m.strides = t.strides().vec();
    return m;
}

at::Tensor in_layout(const at::Tensor& t, const Meta& m) {
    if (m.strides.empty()) return t.contiguous();
    if (t.strides() == at::IntArrayRef(m.strides)) return t;
    return at::empty_strided(m.sizes, m.strides, t.options()).copy_(t);
}

at::Tensor over(void* ptr, const Meta& m, const at::TensorOptions& options, std::function<void(void*)> deleter) {
    if (m.strides.empty()) return at::from_blob(ptr, m.sizes, std::move(deleter), options);
    return at::from_blob(ptr, m.sizes, m.strides, std::move(deleter), options);
}

at::TensorOptions options_of(at::ScalarType dtype, c10::DeviceIndex device) {
    return at::TensorOptions().dtype(dtype).device(at::Device(at::kCUDA, device));
}

namespace {

// Plain string building: no iostreams in the extension (an ostringstream
// crashed inside operator<<(long) on the GPU machine's build, in this very
// error path).
std::string shape_text(at::IntArrayRef sizes) {
    std::string o = "[";
    for (size_t i = 0; i < sizes.size(); ++i) {
        if (i) o += ", ";
        o += std::to_string(sizes[i]);
    }
    return o + "]";
}

}  // namespace

std::string describe(at::IntArrayRef sizes, at::ScalarType dtype, const std::string& device, bool requires_grad) {
    return "shape " + shape_text(sizes) + ", " + c10::toString(dtype) + ", " + device +
           ", requires_grad=" + (requires_grad ? "True" : "False");
}

std::string describe(const at::Tensor& t) {
    return describe(t.sizes(), t.scalar_type(), t.device().str(), t.requires_grad());
}

uint32_t dtype_code(at::ScalarType t, bool* exact) {
    *exact = true;
    switch (t) {
        case at::kFloat: return GRAPHED_DTYPE_F32;
        case at::kHalf: return GRAPHED_DTYPE_F16;
        case at::kBFloat16: return GRAPHED_DTYPE_BF16;
        case at::kDouble: return GRAPHED_DTYPE_F64;
        case at::kChar: return GRAPHED_DTYPE_I8;
        case at::kByte: return GRAPHED_DTYPE_U8;
        case at::kInt: return GRAPHED_DTYPE_I32;
        case at::kLong: return GRAPHED_DTYPE_I64;
        case at::kBool: return GRAPHED_DTYPE_BOOL;
        default: *exact = false; return GRAPHED_DTYPE_U8;
    }
}

std::vector<at::Tensor> wrap_static(void* const* ptrs, const std::vector<Meta>& metas, c10::DeviceIndex device,
                                    bool with_grad) {
    std::vector<at::Tensor> v;
    v.reserve(metas.size());
    for (size_t i = 0; i < metas.size(); ++i) {
        if (!ptrs || !ptrs[i]) {  // no such buffer (the grad of an output without grad)
            v.emplace_back();
            continue;
        }
        at::Tensor t = over(ptrs[i], metas[i], options_of(metas[i].dtype, device));
        v.push_back(with_grad ? t.requires_grad_(metas[i].requires_grad) : t);
    }
    return v;
}

at::Tensor wrap_clone(graphed::Ref& r, const Meta& m, c10::DeviceIndex device) {
    graphed_buffer* owner = r.detach().owner;
    return at::from_blob(r.ptr(), m.sizes, [owner](void*) { graphed::Buffer::adopt(owner).reset(); },
                         options_of(m.dtype, device));
}

std::string hex(const void* p) {
    static const char digits[] = "0123456789abcdef";
    uintptr_t v = reinterpret_cast<uintptr_t>(p);
    std::string o;
    do {
        o.insert(o.begin(), digits[v & 15]);
        v >>= 4;
    } while (v);
    return "0x" + o;
}

std::string layout_text(const at::Tensor& t) {
    std::string o = "shape " + shape_text(t.sizes()) + ", " + c10::toString(t.scalar_type()) + ", " + t.device().str();
    if (t.is_contiguous()) return o + ", contiguous";
    return o + ", strides " + shape_text(t.strides()) + " (not contiguous)";
}

std::string layout_text(const Meta& m, const std::string& device) {
    std::string o = "shape " + shape_text(m.sizes) + ", " + c10::toString(m.dtype) + ", " + device;
    if (m.strides.empty()) return o + ", contiguous";
    return o + ", strides " + shape_text(m.strides);
}

// ---- fresh grads (Options::lazy_clones) ----------------------------------------------------

std::vector<at::Tensor> Shared::fresh_grads(const Callable& c) const {
    std::vector<at::Tensor> v;
    if (!fresh) return v;
    for (size_t j = 0; j < c.params.size(); ++j) {
        if (c.param_info[j].policy != GRAPHED_GRAD_POLICY_COPY_INTO) continue;
        if (v.empty()) v.resize(c.params.size());
        const Meta& m = c.param_info[j].meta;
        v[j] = at::empty(m.sizes, options_of(m.dtype, device));
    }
    return v;
}

at::Tensor Shared::param_grad(const Callable& c, size_t j, uint32_t mb, graphed::Ref& r,
                              const std::shared_ptr<Shared>& self) {
    switch (r.kind()) {
        // Added into (or written into) its destination: autograd gets none
        // here (with DDP, its hook finds it in param.grad, the bucket view).
        case GRAPHED_REF_KIND_ACCUMULATE_INTO:
        case GRAPHED_REF_KIND_COPY_INTO:
        case GRAPHED_REF_KIND_NONE: return at::Tensor();
        case GRAPHED_REF_KIND_CLONE: return wrap_clone(r, c.param_info[j].meta, device);
        default: break;
    }
    // An alias of a grad buffer the adapter provided at capture (a PyTorch
    // tensor) keeps that tensor's memory, and the session only weakly (to
    // let go of its lease under strict leases): held as param.grad, an
    // alias holding the session would make a cycle (the session holds the
    // parameter, whose grad holds the session) that no collector sees, and
    // dropped graphs would never be freed.
    auto same = [&](const at::Tensor& t) { return t.defined() && t.data_ptr() == r.ptr(); };
    const at::Tensor* own = nullptr;
    if (mb < c.per_mb.size())
        for (const auto* ts : {&c.per_mb[mb].ext_pgrad, &c.per_mb[mb].bucket_pgrad})
            for (const at::Tensor& t : *ts)
                if (!own && same(t)) own = &t;
    const Meta& m = c.param_info[j].meta;
    if (own && !r.lease()) return over(r.ptr(), m, options_of(m.dtype, device), [keep = *own](void*) {});
    if (own) {
        auto lease = std::make_shared<graphed::Lease>(std::move(r.lease()));
        leases.hold(lease->id(), c.who(mb) + c.param_name(j) + ".grad");
        std::weak_ptr<Shared> weak = self;
        return over(r.ptr(), m, options_of(m.dtype, device), [keep = *own, weak, lease](void*) {
            if (auto s = weak.lock())
                s->drop_lease(*lease);
            else
                lease->reset();  // the session is gone: nothing left to release
        });
    }
    return wrap_alias(r, c.param_info[j].meta, [&] { return c.who(mb) + c.param_name(j) + ".grad"; }, self);
}

// ---- leases ----------------------------------------------------------------------------------

void StrictLeases::hold(uint64_t id, std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    held_[id] = std::move(what);
}

void StrictLeases::forget(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    held_.erase(id);
}

std::vector<std::string> StrictLeases::alive(const std::string& prefix) const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> names;
    for (const auto& [id, name] : held_)
        if (name.rfind(prefix, 0) == 0) names.push_back(name);
    std::sort(names.begin(), names.end());
    return names;
}

at::Tensor Shared::wrap_leased(graphed::Ref& r, const Meta& m, std::string what, const std::shared_ptr<Shared>& self) {
    auto lease = std::make_shared<graphed::Lease>(std::move(r.lease()));
    leases.hold(lease->id(), std::move(what));
    return over(r.ptr(), m, options_of(m.dtype, device), [self, lease](void*) { self->drop_lease(*lease); });
}

void Shared::drop_lease(graphed::Lease& lease) {
    leases.forget(lease.id());
    // After the session is destroyed the release has nothing left to do.
    lease.reset();
}

void Shared::alias_held(const graphed::Error& e, size_t callable, uint32_t mb) {
    std::string msg = std::string("graphed: ") + e.what();
    const std::vector<std::string> alive = leases.alive(callables[callable]->who(mb));
    if (!alive.empty()) {
        msg += "\nStill alive:";
        for (auto& n : alive) msg += "\n  " + n;
    }
    msg += "\nDrop them (del, or zero_grad(set_to_none=True)) or take a copy (.clone()) before the next replay.";
    throw AliasHeld(msg);
}

}  // namespace graphed_torch
