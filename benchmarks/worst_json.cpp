// worst_json: what the JSON of a stranger's file costs to read, t(N) and memory(N), for each of
// trainloop's three JSON readers, up to each format's limit (docs/models-and-interop.md, "What the
// worst file costs").
//
//   worst_json [--max-mib M] [--repeats R]
//
// For each reader and size N (1, 4, 16, 64 MiB, then the format's limit if --max-mib allows) it
// builds the document that costs that reader the most per byte, then reads it R times, each in a
// child process of its own (fork), so each peak is that read's alone: the seconds (median, min-max)
// and the child's peak resident memory above what it held before the read (ru_maxrss of the child
// minus its RSS at the fork), and that peak per byte of input. The readers:
// - safetensors header: parse_safetensors_header, a header of `__metadata__` entries "k":"" with
//   short keys (the most JSON values per byte the format takes; refused after 65,536 keys);
// - safetensors tensors: the same reader, empty tensors `"k":{"dtype":"U8","shape":[0],
//   "data_offsets":[0,0]}` (all valid: every one becomes an entry, sorted and checked);
// - safetensors index: SafetensorsSource's index reader, weight_map entries "k":"f" (read from a
//   file, as it is);
// - .pt2 program: parse_untrusted_json (what Pt2Archive reads models/*.json with), a list of empty
//   objects `[{},{},...]`, the most values per byte JSON allows (charged 32 bytes per byte: refused
//   before parsing, json_dom_cost.hpp), and a list of zeros `[0,0,...]`, the costliest document it
//   still parses (charged 16 per byte, the bound).
// Each document is valid JSON; the safetensors and .pt2 readers then refuse it after parsing (it
// is not a header of tensors, not a program), which is the work a stranger can make them do.
#include <trainloop/serialization/export/export_json.hpp>
#include <trainloop/serialization/safetensors/safetensors_index.hpp>

#include <CLI/CLI.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace {

/// The process's resident memory now, in KiB (from /proc/self/statm).
long resident_kib() {
  long pages_total = 0, pages_resident = 0;
  if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(statm, "%ld %ld", &pages_total, &pages_resident) != 2) pages_resident = 0;
    std::fclose(statm);
  }
  return pages_resident * (::sysconf(_SC_PAGESIZE) / 1024);
}

struct Sample {
  double seconds = 0;
  double peak_mib = 0;  // above the RSS at the start of the read
};

/// Runs `read` in a child process; its wall time and peak memory above its start.
Sample measure(const std::function<void()>& read) {
  int pipe_fds[2];
  if (::pipe(pipe_fds) != 0) return {};
  const pid_t child = ::fork();
  if (child == 0) {
    ::close(pipe_fds[0]);
    const long before = resident_kib();
    const auto start = std::chrono::steady_clock::now();
    try {
      read();
    } catch (const std::exception&) {  // the readers refuse these documents after parsing them
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    rusage usage{};
    ::getrusage(RUSAGE_SELF, &usage);
    const double result[2] = {seconds, static_cast<double>(usage.ru_maxrss - before) / 1024.0};
    if (::write(pipe_fds[1], result, sizeof result) != static_cast<ssize_t>(sizeof result)) ::_exit(2);
    ::_exit(0);
  }
  ::close(pipe_fds[1]);
  double result[2] = {0, 0};
  const bool got = ::read(pipe_fds[0], result, sizeof result) == static_cast<ssize_t>(sizeof result);
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return got ? Sample{result[0], result[1]} : Sample{-1, -1};
}

/// A JSON document of about `bytes` bytes: `open`, then `item(i)` joined by commas, then `close`.
std::string document_of(uint64_t bytes, const std::string& open, const std::function<std::string(uint64_t)>& item,
                        const std::string& close) {
  std::string text = open;
  text.reserve(bytes + 64);
  for (uint64_t i = 0; text.size() + close.size() < bytes; ++i) {
    if (i > 0) text += ',';
    text += item(i);
  }
  return text + close;
}

/// A short key per index: base-36 digits, unique.
std::string key_of(uint64_t i) {
  std::string key;
  do {
    key += "0123456789abcdefghijklmnopqrstuvwxyz"[i % 36];
    i /= 36;
  } while (i > 0);
  return key;
}

}  // namespace

int main(int argc, char** argv) {
  namespace ser = trainloop::serialization;
  CLI::App app{"t(N) and memory(N) of trainloop's JSON readers on the worst documents"};
  double max_mib = 256;
  int repeats = 3;
  app.add_option("--max-mib", max_mib, "largest document, MiB (the formats' limits: safetensors 95.4, .pt2 256)");
  app.add_option("--repeats", repeats, "reads per size, each in a fresh child process")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  const auto dir = std::filesystem::temp_directory_path() / ("trainloop-worst-json-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  struct Reader {
    const char* name;
    uint64_t limit;
    std::function<std::string(uint64_t)> make;
    std::function<void(const std::string&)> read;
  };
  const std::vector<Reader> readers{
      {"safetensors header", ser::kSafetensorsMaxHeaderBytes,
       [](uint64_t n) { return document_of(n, "{\"__metadata__\":{", [](uint64_t i) { return "\"" + key_of(i) + "\":\"\""; }, "}}"); },
       [](const std::string& text) { ser::parse_safetensors_header(text, 0, "worst.safetensors"); }},
      {"safetensors tensors", ser::kSafetensorsMaxHeaderBytes,
       [](uint64_t n) {
         return document_of(n, "{", [](uint64_t i) { return "\"" + key_of(i) + "\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}"; }, "}");
       },
       [](const std::string& text) { ser::parse_safetensors_header(text, 0, "worst.safetensors"); }},
      {"safetensors index", ser::kSafetensorsMaxHeaderBytes,
       [](uint64_t n) {
         return document_of(n, "{\"weight_map\":{", [](uint64_t i) { return "\"" + key_of(i) + "\":\"f\""; }, "}}");
       },
       [&dir](const std::string&) { ser::SafetensorsSource source(dir / "model.safetensors.index.json"); }},
      {".pt2 program {}", uint64_t(256) << 20,
       [](uint64_t n) { return document_of(n, "[", [](uint64_t) { return std::string("{}"); }, "]"); },
       [](const std::string& text) { ser::parse_untrusted_json(text, "models/model.json", 64); }},
      {".pt2 program 0", uint64_t(256) << 20,
       [](uint64_t n) { return document_of(n, "[", [](uint64_t) { return std::string("0"); }, "]"); },
       [](const std::string& text) { ser::parse_untrusted_json(text, "models/model.json", 64); }},
  };
  std::printf("%-20s %10s %24s %22s %10s\n", "reader", "MiB", "seconds median (min-max)", "peak MiB median", "bytes/B");
  for (const auto& reader : readers) {
    std::vector<uint64_t> sizes;
    for (uint64_t mib : {1, 4, 16, 64}) {
      if (mib <= max_mib && (mib << 20) < reader.limit) sizes.push_back(mib << 20);
    }
    if (static_cast<double>(reader.limit) <= max_mib * 1048576.0) sizes.push_back(reader.limit - 64);
    for (const uint64_t size : sizes) {
      const std::string text = reader.make(size);
      std::ofstream(dir / "model.safetensors.index.json", std::ios::binary | std::ios::trunc) << text;  // the index reader's file
      std::vector<Sample> samples;
      for (int r = 0; r < repeats; ++r) samples.push_back(measure([&] { reader.read(text); }));
      std::sort(samples.begin(), samples.end(), [](const Sample& a, const Sample& b) { return a.seconds < b.seconds; });
      std::vector<double> peaks;
      for (const auto& s : samples) peaks.push_back(s.peak_mib);
      std::sort(peaks.begin(), peaks.end());
      const double mib = static_cast<double>(text.size()) / 1048576.0;
      const double peak = peaks[peaks.size() / 2];
      std::printf("%-20s %10.1f %10.3f (%.3f-%.3f) %22.0f %10.1f\n", reader.name, mib, samples[samples.size() / 2].seconds,
                  samples.front().seconds, samples.back().seconds, peak, peak / mib);
      std::fflush(stdout);
    }
  }
  std::filesystem::remove_all(dir);
  return 0;
}
