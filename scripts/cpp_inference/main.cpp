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
// A model directory's file is checked first against the SHA-256 its manifest records (files.<name>.
// sha256): a damaged or edited file is refused (exit 2), as Python refuses it.
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
#include <cstdio>
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

// Where the value of a top-level key of the JSON object `s` starts (std::string::npos when absent).
size_t top_level_value(const std::string& s, const std::string& key) {
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
        return j;
      }
      continue;
    }
    if (c == '{' || c == '[') ++depth;
    if (c == '}' || c == ']') --depth;
    ++i;
  }
  return std::string::npos;
}

// The string value of a top-level key of a JSON object ("" when absent, null or not a string).
std::string top_level_string(const std::string& s, const std::string& key) {
  size_t j = top_level_value(s, key);
  return j < s.size() && s[j] == '"' ? json_string(s, j) : std::string();
}

// SHA-256 (FIPS 180-4) of a file's bytes as 64 hex digits; "" when it cannot be read.
std::string sha256_file(const std::string& path) {
  static const uint32_t K[64] = {
      0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
      0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
      0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
      0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
      0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
      0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
      0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
      0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  auto rotr = [](uint32_t x, int n) { return (x >> n) | (x << (32 - n)); };
  auto block = [&](const unsigned char* p) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i) w[i] = uint32_t(p[4 * i]) << 24 | uint32_t(p[4 * i + 1]) << 16 | uint32_t(p[4 * i + 2]) << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
      const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; ++i) {
      const uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
  };
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::string();
  std::vector<unsigned char> buf(1 << 20);
  uint64_t total = 0;
  size_t have = 0;  // bytes of a partial block at the front of buf
  while (in) {
    in.read(reinterpret_cast<char*>(buf.data() + have), static_cast<std::streamsize>(buf.size() - have));
    const size_t n = have + static_cast<size_t>(in.gcount());
    total += static_cast<uint64_t>(in.gcount());
    size_t off = 0;
    for (; off + 64 <= n; off += 64) block(buf.data() + off);
    have = n - off;
    std::memmove(buf.data(), buf.data() + off, have);
  }
  if (in.bad()) return std::string();
  unsigned char tail[128] = {0};
  std::memcpy(tail, buf.data(), have);
  tail[have] = 0x80;
  const size_t len = have + 1 + 8 <= 64 ? 64 : 128;
  for (int i = 0; i < 8; ++i) tail[len - 1 - i] = static_cast<unsigned char>((total * 8) >> (8 * i));
  for (size_t off = 0; off < len; off += 64) block(tail + off);
  std::ostringstream hex;
  for (uint32_t v : h) {
    char part[9];
    std::snprintf(part, sizeof(part), "%08x", v);
    hex << part;
  }
  return hex.str();
}

// The text of the object value of key `key` at the top level of the JSON object `s` ("" when absent).
std::string top_level_object(const std::string& s, const std::string& key) {
  const size_t j = top_level_value(s, key);
  if (j >= s.size() || s[j] != '{') return std::string();
  int d = 0;
  for (size_t k = j; k < s.size(); ++k) {
    if (s[k] == '"') {  // skip the string (braces inside it do not count)
      json_string(s, k);
      --k;
      continue;
    }
    if (s[k] == '{') ++d;
    if (s[k] == '}' && --d == 0) return s.substr(j, k - j + 1);
  }
  return std::string();
}

// The model file's bytes are those the manifest records (files.<name>.sha256, or model_sha256 of
// model_file in older manifests): false (message printed) when not, or when nothing is recorded.
bool check_recorded_sha256(const std::string& model, const std::string& js, const std::string& name) {
  std::string want = top_level_string(top_level_object(top_level_object(js, "files"), name), "sha256");
  if (want.empty() && name == top_level_string(js, "model_file")) want = top_level_string(js, "model_sha256");
  const std::string path = model + "/" + name;
  if (want.empty()) {
    std::cerr << "error: " << model << "/manifest.json records no SHA-256 for " << name
              << "; export again (dlrmctl export RUN_DIR --aot)\n";
    return false;
  }
  const std::string got = sha256_file(path);
  if (got != want) {
    std::cerr << "error: " << path << ": SHA-256 " << (got.empty() ? std::string("(unreadable)") : got.substr(0, 16) + "...")
              << " differs from the " << want.substr(0, 16) << "... manifest.json records (damaged or edited); "
              << "copy the artifact again or export again\n";
    return false;
  }
  return true;
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
    return check_recorded_sha256(model, js, package);
  }
  if (artifact == "torchscript") {
    const std::string file = top_level_string(js, "model_file");
    path = model + "/" + (file.empty() ? std::string("model.pt") : file);
    aoti = false;
    return check_recorded_sha256(model, js, file.empty() ? std::string("model.pt") : file);
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
