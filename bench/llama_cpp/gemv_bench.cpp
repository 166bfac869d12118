// One ggml mul_mat (y = W x) timed by llama.cpp's own CPU backend, for side-by-side kernel comparisons
// (bench/bench_cpu_vs_llama.py loads this library with ctypes and alternates calls with k3run's kernels).
// The weight lives in the CPU backend's repack buffer type where ggml has a repacked layout for it
// (Q4_0 -> q4_0_8x8, Q4_K -> q4_K_8x8 on AVX2 / AVX-512 machines: llama.cpp's fastest CPU 4-bit paths),
// else in a plain CPU buffer. Build (LC = a llama.cpp tree built as bench/llama_cpp/README.md says):
//   g++ -O2 -std=c++17 -shared -fPIC gemv_bench.cpp -I$LC/ggml/include -L$LC/build/bin -lggml -lggml-base
//       -lggml-cpu -Wl,-rpath,$LC/build/bin -o libgemv_bench.so
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml.h"

struct Bench {
  ggml_backend_t backend = nullptr;
  ggml_context* wctx = nullptr;
  ggml_context* cctx = nullptr;
  ggml_backend_buffer_t wbuf = nullptr;
  ggml_backend_buffer_t cbuf = nullptr;
  ggml_cgraph* graph = nullptr;
  bool repacked = false;
};

static ggml_backend_buffer_type_t repack_buft() {
  ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
  ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
  auto fn = (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(
      reg, "ggml_backend_dev_get_extra_bufts");
  if (!fn) return nullptr;
  for (ggml_backend_buffer_type_t* b = fn(dev); b && *b; ++b)
    if (std::strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
  return nullptr;
}

extern "C" {

// type: a ggml_type number (GGML_TYPE_Q4_0 = 2, Q4_K = 12, ...); W [n, k] from a seeded normal, x [m, k]
void* gb_create(int type, int64_t n, int64_t k, int64_t m, int threads, int use_repack) {
  auto* b = new Bench();
  b->backend = ggml_backend_cpu_init();
  ggml_backend_cpu_set_n_threads(b->backend, threads);
  ggml_init_params wp = {ggml_tensor_overhead() * 4, nullptr, true};
  b->wctx = ggml_init(wp);
  ggml_tensor* w = ggml_new_tensor_2d(b->wctx, (ggml_type)type, k, n);
  ggml_backend_buffer_type_t rb = use_repack ? repack_buft() : nullptr;
  if (rb) b->wbuf = ggml_backend_alloc_ctx_tensors_from_buft(b->wctx, rb);
  if (!b->wbuf) b->wbuf = ggml_backend_alloc_ctx_tensors(b->wctx, b->backend);
  b->repacked = rb && ggml_backend_buffer_get_type(b->wbuf) == rb;
  std::mt19937 gen(1234);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> wf(n * k);
  for (auto& v : wf) v = nd(gen);
  std::vector<uint8_t> wq(ggml_row_size((ggml_type)type, k) * n);
  ggml_quantize_chunk((ggml_type)type, wf.data(), wq.data(), 0, n, k, nullptr);
  ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
  ggml_init_params cp = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
  b->cctx = ggml_init(cp);
  ggml_tensor* x = ggml_new_tensor_2d(b->cctx, GGML_TYPE_F32, k, m);
  ggml_tensor* y = ggml_mul_mat(b->cctx, w, x);
  b->graph = ggml_new_graph(b->cctx);
  ggml_build_forward_expand(b->graph, y);
  b->cbuf = ggml_backend_alloc_ctx_tensors(b->cctx, b->backend);
  std::vector<float> xf(m * k);
  for (auto& v : xf) v = nd(gen);
  ggml_backend_tensor_set(x, xf.data(), 0, xf.size() * sizeof(float));
  return b;
}

int gb_repacked(void* h) { return static_cast<Bench*>(h)->repacked ? 1 : 0; }

int gb_run(void* h) {
  auto* b = static_cast<Bench*>(h);
  return ggml_backend_graph_compute(b->backend, b->graph) == GGML_STATUS_SUCCESS ? 0 : 1;
}

void gb_free(void* h) {
  auto* b = static_cast<Bench*>(h);
  ggml_backend_buffer_free(b->cbuf);
  ggml_backend_buffer_free(b->wbuf);
  ggml_free(b->cctx);
  ggml_free(b->wctx);
  ggml_backend_free(b->backend);
  delete b;
}
}
