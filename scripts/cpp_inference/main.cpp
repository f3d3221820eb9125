// dlrm_infer: score a batch with a dlrmctl exported model from C++ (libtorch + FBGEMM ops).
//
// Usage: dlrm_infer MODEL.pt INPUT.bin OUTPUT.bin FBGEMM_GPU_DIR
//
// FBGEMM_GPU_DIR is the installed fbgemm_gpu package directory (python -c 'import fbgemm_gpu,os;
// print(os.path.dirname(fbgemm_gpu.__file__))'); its operator libraries are dlopen'ed in the same
// order as fbgemm_gpu/__init__.py loads them (the C++ equivalent of torch.ops.load_library).
//
// INPUT.bin (little-endian, written by dlrmctl.inference.predict.write_cpp_input):
//   8 bytes magic "DLRMIN01", int64 B, int64 D, int64 N, int64 FB,
//   float32 dense[B*D] (row-major), int64 values[N], int64 lengths[FB] (key-major);
//   or magic "DLRMIN02" (a model with weighted features): the same, then float32 weights[N]
//   (per-id weights aligned with values), passed as the module's 4th input.
// OUTPUT.bin: 8 bytes magic "DLRMOUT1", int64 B, float32 scores[B].
// Exit codes: 0 ok, 1 usage, 2 library load failure, 3 bad input file, 4 model error.
#include <torch/script.h>

#include <dlfcn.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

namespace {

// Same list and order as fbgemm_gpu/__init__.py (fbgemm_gpu_libraries).
const char* kFbgemmLibs[] = {
    "fbgemm_gpu_config",
    "fbgemm_gpu_tbe_utils",
    "fbgemm_gpu_tbe_index_select",
    "fbgemm_gpu_tbe_cache",
    "fbgemm_gpu_tbe_optimizers",
    "fbgemm_gpu_tbe_inference",
    "fbgemm_gpu_tbe_training_forward",
    "fbgemm_gpu_tbe_training_backward",
    "fbgemm_gpu_tbe_training_backward_pt2",
    "fbgemm_gpu_tbe_training_backward_dense",
    "fbgemm_gpu_tbe_training_backward_split_host",
    "fbgemm_gpu_tbe_training_backward_gwd",
    "fbgemm_gpu_tbe_training_backward_vbe",
    "fbgemm_gpu_py",
};

bool file_exists(const std::string& p) {
  std::ifstream f(p);
  return f.good();
}

int load_fbgemm(const std::string& dir) {
  int loaded = 0;
  for (const char* name : kFbgemmLibs) {
    std::string path = dir + "/" + name + ".so";
    if (!file_exists(path)) {
      continue;  // older / newer wheels split the libraries differently
    }
    if (dlopen(path.c_str(), RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::cerr << "error: cannot load " << path << ": " << dlerror() << "\n";
      return -1;
    }
    ++loaded;
  }
  return loaded;
}

template <typename T>
bool read_vec(std::ifstream& f, std::vector<T>& v, int64_t n) {
  v.resize(static_cast<size_t>(n));
  f.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(T)));
  return static_cast<bool>(f);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt INPUT.bin OUTPUT.bin FBGEMM_GPU_DIR\n";
    return 1;
  }
  const std::string model_path = argv[1], in_path = argv[2], out_path = argv[3], fb_dir = argv[4];

  const int n = load_fbgemm(fb_dir);
  if (n < 0) return 2;
  if (!file_exists(fb_dir + "/fbgemm_gpu_py.so")) {
    std::cerr << "error: " << fb_dir << "/fbgemm_gpu_py.so not found; pass the fbgemm_gpu package directory\n";
    return 2;
  }

  std::ifstream f(in_path, std::ios::binary);
  char magic[8];
  int64_t hdr[4];
  if (!f.read(magic, 8) || (std::memcmp(magic, "DLRMIN01", 8) != 0 && std::memcmp(magic, "DLRMIN02", 8) != 0) ||
      !f.read(reinterpret_cast<char*>(hdr), sizeof(hdr))) {
    std::cerr << "error: " << in_path << ": not a DLRMIN01 / DLRMIN02 input file\n";
    return 3;
  }
  const bool weighted = std::memcmp(magic, "DLRMIN02", 8) == 0;
  const int64_t B = hdr[0], D = hdr[1], N = hdr[2], FB = hdr[3];
  std::vector<float> dense;
  std::vector<float> weights;
  std::vector<int64_t> values, lengths;
  if (B < 0 || D < 0 || N < 0 || FB < 0 || !read_vec(f, dense, B * D) || !read_vec(f, values, N) ||
      !read_vec(f, lengths, FB) || (weighted && !read_vec(f, weights, N))) {
    std::cerr << "error: " << in_path << ": truncated (B=" << B << " D=" << D << " N=" << N << " FB=" << FB << ")\n";
    return 3;
  }

  torch::jit::script::Module module;
  try {
    module = torch::jit::load(model_path);
    module.eval();
  } catch (const c10::Error& e) {
    std::cerr << "error: cannot load " << model_path << ": " << e.what_without_backtrace() << "\n";
    return 4;
  }
  torch::NoGradGuard no_grad;
  auto t_dense = torch::from_blob(dense.data(), {B, D}, torch::kFloat32);
  auto t_values = torch::from_blob(values.data(), {N}, torch::kInt64);
  auto t_lengths = torch::from_blob(lengths.data(), {FB}, torch::kInt64);
  std::vector<torch::jit::IValue> inputs{t_dense, t_values, t_lengths};
  if (weighted) inputs.emplace_back(torch::from_blob(weights.data(), {N}, torch::kFloat32));
  torch::Tensor scores;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    scores = module.forward(inputs).toTensor().contiguous().to(torch::kFloat32);
  } catch (const std::exception& e) {
    std::cerr << "error: model rejected the input: " << e.what() << "\n";
    return 4;
  }
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  std::ofstream o(out_path, std::ios::binary);
  const int64_t nb = scores.numel();
  o.write("DLRMOUT1", 8);
  o.write(reinterpret_cast<const char*>(&nb), sizeof(nb));
  o.write(reinterpret_cast<const char*>(scores.data_ptr<float>()), static_cast<std::streamsize>(nb * sizeof(float)));
  if (!o) {
    std::cerr << "error: cannot write " << out_path << "\n";
    return 3;
  }
  std::cout << "scored " << nb << " samples in " << ms << " ms (" << n << " fbgemm libraries loaded); first:";
  for (int64_t i = 0; i < std::min<int64_t>(nb, 4); ++i) std::cout << " " << scores[i].item<float>();
  std::cout << "\n";
  return 0;
}
