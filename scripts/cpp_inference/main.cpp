// dlrm_infer: score a batch with a dlrmctl exported model from C++ (libtorch).
//
// Usage: dlrm_infer MODEL INPUT.bin OUTPUT.bin [FBGEMM_GPU_DIR]
//
// MODEL is the exported model directory; its manifest.json says which loader runs it:
//   * "aoti_package" set (dlrmctl export --aot): the AOTInductor package (model_aoti.pt2) through
//     torch::inductor::AOTIModelPackageLoader -- compiled code, no fbgemm_gpu, no Python;
//   * "artifact": "torchscript" (dlrmctl export --torchscript): model.pt through torch::jit::load,
//     with FBGEMM's operator libraries dlopen'ed from FBGEMM_GPU_DIR (required then);
//   * a plain "pt2" artifact without a package is refused (it is a Python torch.export program:
//     export again with --aot).
// MODEL may also be a file: *.pt2 is taken as an AOTInductor package, anything else as TorchScript.
//
// FBGEMM_GPU_DIR is the installed fbgemm_gpu package directory (python -c 'import fbgemm_gpu,os;
// print(os.path.dirname(fbgemm_gpu.__file__))'); its operator libraries are dlopen'ed in the same
// order as fbgemm_gpu/__init__.py loads them (the C++ equivalent of torch.ops.load_library).
//
// INPUT.bin (little-endian, written by dlrmctl.inference.predict.write_cpp_input):
//   8 bytes magic "DLRMIN01", int64 B, int64 D, int64 N, int64 FB,
//   float32 dense[B*D] (row-major), int64 values[N], int64 lengths[FB] (key-major);
//   or magic "DLRMIN02" (a model with weighted features): the same, then float32 weights[N]
//   (per-id weights aligned with values), passed as the model's 4th input.
// OUTPUT.bin: 8 bytes magic "DLRMOUT1", int64 B, float32 scores[B].
// Exit codes: 0 ok, 1 usage, 2 library / manifest problem, 3 bad input file, 4 model error.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>
#include <torch/script.h>

#include <dlfcn.h>

#include <cctype>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <sys/stat.h>
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

bool is_dir(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
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

// A JSON string starting at s[i] == '"' -> its value (escapes \" \\ \/ \n \t kept simple); i moves past it.
std::string json_string(const std::string& s, size_t& i) {
  std::string out;
  for (++i; i < s.size() && s[i] != '"'; ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      ++i;
      out += s[i] == 'n' ? '\n' : s[i] == 't' ? '\t' : s[i];
    } else {
      out += s[i];
    }
  }
  ++i;
  return out;
}

// The string value of a top-level key of a JSON object ("" when absent, null or not a string).
std::string top_level_string(const std::string& s, const std::string& key) {
  int depth = 0;
  for (size_t i = 0; i < s.size();) {
    const char c = s[i];
    if (c == '"') {
      const bool at_top = depth == 1;
      const std::string str = json_string(s, i);
      size_t j = i;
      while (j < s.size() && std::isspace(static_cast<unsigned char>(s[j]))) ++j;
      if (at_top && j < s.size() && s[j] == ':' && str == key) {
        for (++j; j < s.size() && std::isspace(static_cast<unsigned char>(s[j]));) ++j;
        return j < s.size() && s[j] == '"' ? json_string(s, j) : std::string();
      }
      continue;
    }
    if (c == '{' || c == '[') ++depth;
    if (c == '}' || c == ']') --depth;
    ++i;
  }
  return std::string();
}

// Which file of MODEL to run and how: returns false (message printed) when it cannot be decided.
bool resolve_model(const std::string& model, std::string& path, bool& aoti) {
  if (!is_dir(model)) {
    path = model;
    aoti = model.size() >= 4 && model.compare(model.size() - 4, 4, ".pt2") == 0;
    return true;
  }
  const std::string mpath = model + "/manifest.json";
  std::ifstream mf(mpath);
  if (!mf) {
    std::cerr << "error: " << mpath << ": not found; " << model
              << " is not an exported model (create one with `dlrmctl export RUN_DIR --aot`)\n";
    return false;
  }
  std::stringstream ss;
  ss << mf.rdbuf();
  const std::string js = ss.str();
  std::string artifact = top_level_string(js, "artifact");
  if (artifact.empty()) artifact = "torchscript";  // manifests before "artifact"
  const std::string package = top_level_string(js, "aoti_package");
  if (!package.empty()) {
    path = model + "/" + package;
    aoti = true;
    return true;
  }
  if (artifact == "torchscript") {
    const std::string file = top_level_string(js, "model_file");
    path = model + "/" + (file.empty() ? std::string("model.pt") : file);
    aoti = false;
    return true;
  }
  std::cerr << "error: " << mpath << ": artifact '" << artifact
            << "' has no AOTInductor package (aoti_package is null); C++ runs the package of `dlrmctl export "
               "RUN_DIR --aot` or a `--torchscript` model.pt: export again with one of them\n";
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::cerr << "usage: " << argv[0] << " MODEL_DIR INPUT.bin OUTPUT.bin [FBGEMM_GPU_DIR]\n";
    return 1;
  }
  const std::string model_arg = argv[1], in_path = argv[2], out_path = argv[3];
  const std::string fb_dir = argc == 5 ? argv[4] : "";

  std::string model_path;
  bool aoti = false;
  if (!resolve_model(model_arg, model_path, aoti)) return 2;
  int n_libs = 0;
  if (!aoti) {  // TorchScript: FBGEMM's TBE operators must be registered before torch::jit::load
    if (fb_dir.empty() || !file_exists(fb_dir + "/fbgemm_gpu_py.so")) {
      std::cerr << "error: " << model_path << " is a TorchScript model on FBGEMM operators; pass the fbgemm_gpu "
                << "package directory (holding fbgemm_gpu_py.so) as the 4th argument"
                << (fb_dir.empty() ? "" : " (" + fb_dir + " has none)") << "\n";
      return 2;
    }
    n_libs = load_fbgemm(fb_dir);
    if (n_libs < 0) return 2;
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

  auto t_dense = torch::from_blob(dense.data(), {B, D}, torch::kFloat32);
  auto t_values = torch::from_blob(values.data(), {N}, torch::kInt64);
  auto t_lengths = torch::from_blob(lengths.data(), {FB}, torch::kInt64);
  torch::NoGradGuard no_grad;
  torch::Tensor scores;
  std::function<torch::Tensor()> run;
  std::unique_ptr<torch::inductor::AOTIModelPackageLoader> package;
  torch::jit::script::Module module;
  try {
    if (aoti) {
      // the package's (scores, logits) program; its shape guards and id checks are compiled in
      package = std::make_unique<torch::inductor::AOTIModelPackageLoader>(model_path);
      run = [&]() {
        std::vector<torch::Tensor> in{t_dense, t_values, t_lengths};
        if (weighted) in.push_back(torch::from_blob(weights.data(), {N}, torch::kFloat32));
        return package->run(in).at(0);
      };
    } else {
      module = torch::jit::load(model_path);
      module.eval();
      run = [&]() {
        std::vector<torch::jit::IValue> in{t_dense, t_values, t_lengths};
        if (weighted) in.emplace_back(torch::from_blob(weights.data(), {N}, torch::kFloat32));
        return module.forward(in).toTensor();
      };
    }
  } catch (const c10::Error& e) {
    std::cerr << "error: cannot load " << model_path << ": " << e.what_without_backtrace() << "\n";
    return 4;
  } catch (const std::exception& e) {
    std::cerr << "error: cannot load " << model_path << ": " << e.what() << "\n";
    return 4;
  }
  const auto t0 = std::chrono::steady_clock::now();
  try {
    scores = run().contiguous().to(torch::kFloat32);
  } catch (const c10::Error& e) {
    std::cerr << "error: model rejected the input: " << e.what_without_backtrace() << "\n";
    return 4;
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
  std::cout << "scored " << nb << " samples in " << ms << " ms ("
            << (aoti ? std::string("AOTInductor package") : "TorchScript, " + std::to_string(n_libs) + " fbgemm libraries loaded")
            << "); first:";
  for (int64_t i = 0; i < std::min<int64_t>(nb, 4); ++i) std::cout << " " << scores[i].item<float>();
  std::cout << "\n";
  return 0;
}
