// CUDA smoke test: on a GPU machine the library sees at least one device and
// a kernel runs; without a driver or a GPU it skips with the library's reason.
#include <graphed.h>

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <vector>

namespace {

__global__ void add_one(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}

TEST(CudaSmoke, DeviceCountAndKernel) {
    uint32_t count = 0;
    graphed_status s = graphed_device_count(&count);
    if (s == GRAPHED_STATUS_NO_DRIVER || s == GRAPHED_STATUS_NO_DEVICE) {
        GTEST_SKIP() << "no GPU here (" << graphed_status_name(s) << "): " << graphed_last_error_message();
    }
    ASSERT_EQ(GRAPHED_STATUS_OK, s) << graphed_last_error_message();
    ASSERT_GE(count, 1u);

    int runtime_count = 0;
    ASSERT_EQ(cudaSuccess, cudaGetDeviceCount(&runtime_count));
    EXPECT_EQ(static_cast<int>(count), runtime_count) << "the library and the runtime disagree";

    const int n = 1 << 20;
    std::vector<float> host(n);
    for (int i = 0; i < n; ++i) host[i] = static_cast<float>(i % 977) * 0.5f;
    float* dev = nullptr;
    ASSERT_EQ(cudaSuccess, cudaMalloc(&dev, n * sizeof(float)));
    ASSERT_EQ(cudaSuccess, cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
    add_one<<<(n + 255) / 256, 256>>>(dev, n);
    ASSERT_EQ(cudaSuccess, cudaGetLastError());
    std::vector<float> back(n);
    ASSERT_EQ(cudaSuccess, cudaMemcpy(back.data(), dev, n * sizeof(float), cudaMemcpyDeviceToHost));
    ASSERT_EQ(cudaSuccess, cudaFree(dev));
    for (int i = 0; i < n; ++i) {
        ASSERT_EQ(host[i] + 1.0f, back[i]) << "element " << i;
    }
}

}  // namespace
