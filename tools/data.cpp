// ringattn-data: text files -> token datasets for the trainer, with the byte-level tokenizer
// (one token per byte, vocab 256).
//
//   ringattn-data --out data/text.h5 [--val-fraction 0.05] [--eod-token ID] FILE...
//
// writes two datasets in the format of train/token_dataset.hpp: data/text.train.h5 and
// data/text.val.h5. Each input is split on its own, its last floor(size * fraction) bytes going to
// validation, so validation draws from every file; the files are concatenated in argument order,
// without separators. Document boundaries are kept (`document_starts`, which the trainer packs
// into sequences: train/documents.hpp): each file's part of a split begins a document, and with
// --eod-token every byte of that value ends one (it stays the last token of its document). Both outputs appear only when complete (written as .tmp, then renamed).
// Before any byte is converted, the inputs are checked readable and the outputs writable.
#include <CLI/CLI.hpp>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <new>
#include <string>
#include <vector>

#include "ringattn/error.hpp"
#include "tools/cli_checks.hpp"
#include "train/token_dataset_writer.hpp"

namespace {

namespace fs = std::filesystem;
using ringattn::ErrorKind;
using ringattn::train::TokenDatasetWriter;

constexpr int kByteVocab = 256;
constexpr std::size_t kBlockBytes = std::size_t{1} << 20;

struct Input {
  fs::path path;
  std::int64_t bytes = 0;
  std::int64_t val_bytes = 0;  // the tail that goes to validation
};

// Appends bytes [begin, end) of `input` to `writer` as tokens, a block at a time.
void copy_bytes(const Input& input, std::int64_t begin, std::int64_t end,
                TokenDatasetWriter& writer) {
  std::ifstream file(input.path, std::ios::binary);
  file.seekg(begin);
  std::vector<char> block(kBlockBytes);
  std::vector<std::int32_t> tokens;
  for (std::int64_t at = begin; at < end;) {
    const auto want = static_cast<std::streamsize>(std::min<std::int64_t>(end - at, kBlockBytes));
    file.read(block.data(), want);
    if (file.gcount() != want) {
      ringattn::detail::fail_as(ErrorKind::io, "ringattn-data", "'", input.path.string(),
                                "' ended at byte ", at + file.gcount(), " while ", input.bytes,
                                " were expected (did it change during the conversion?)");
    }
    tokens.resize(static_cast<std::size_t>(want));
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<unsigned char>(block[i]);
    }
    writer.append(tokens);
    at += want;
  }
}

// --out without a trailing .h5: the outputs are STEM.train.h5 and STEM.val.h5.
std::string output_stem(std::string out) {
  if (out.ends_with(".h5")) out.resize(out.size() - 3);
  return out;
}

fs::path output_path(const fs::path& out, const char* split) {
  return output_stem(out.string()) + "." + split + ".h5";
}

// --out: a name that is left once a trailing .h5 is dropped ("", ".h5" or "dir/" would write the
// hidden file .train.h5).
CLI::Validator output_name() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const fs::path name = fs::path(output_stem(text)).filename();
        if (!name.empty() && name != "." && name != "..") return {};
        return "got '" + text + "', expected a file name such as data/text.h5";
      },
      "");
}

// --val-fraction: a number from 0 up to, not including, 1.
CLI::Validator fraction_below_one() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        double value = -1.0;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error == std::errc{} && end == text.data() + text.size() && value >= 0.0 &&
            value < 1.0) {
          return {};
        }
        return "got '" + text + "', expected a number >= 0 and < 1";
      },
      "in [0, 1)");
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "ringattn-data: turn text files into token datasets for ringattn-train, with the byte-level\n"
      "tokenizer (one token per byte, vocab_size 256, tokens stored as uint16).\n\n"
      "Writes two files: OUT without its .h5, plus .train.h5 and .val.h5 (--out data/text.h5\n"
      "gives data/text.train.h5 and data/text.val.h5; with --val-fraction 0 only the first).\n"
      "Each input is split on its own: its last floor(size * FRACTION) bytes go to validation.\n"
      "Inputs are concatenated in argument order, without separators; each file begins a\n"
      "document, and with --eod-token ID every byte ID ends one (it stays the document's last\n"
      "token), stored as document_starts beside the tokens. Use the result with\n"
      "  --set data.source=hdf5 --set data.train_path=... --set data.val_path=..."};
  std::string out;
  double val_fraction = 0.05;
  std::vector<std::string> files;
  int eod_token = -1;
  app.add_option("--out", out, "output name: OUT.train.h5 and OUT.val.h5 (a trailing .h5 dropped)")
      ->required()
      ->check(output_name());
  app.add_option("--val-fraction", val_fraction,
                 "fraction of each file for validation, 0 <= FRACTION < 1 (default 0.05)")
      ->check(fraction_below_one());
  app.add_option("--eod-token", eod_token,
                 "end-of-document token: a byte value 0..255 (e.g. 0 for NUL, 10 for a newline) "
                 "after which a new document starts; without it each file is one document")
      ->check(CLI::Range(0, kByteVocab - 1));
  app.add_option("FILE", files, "text files")->required();
  const ringattn::tools::CommandLine line = ringattn::tools::parse_command_line(app, argc, argv);
  if (line.exit_code >= 0) return ringattn::tools::finish_command_line(line, "ringattn-data");

  try {
    std::vector<Input> inputs;
    std::int64_t total = 0, val_total = 0;
    for (const std::string& name : files) {
      std::error_code error;
      if (!fs::is_regular_file(name, error)) {
        ringattn::detail::fail_as(
            ErrorKind::io, "ringattn-data", "input '", name, "' ",
            fs::exists(name, error) ? "is not a regular file" : "does not exist");
      }
      Input input{name, static_cast<std::int64_t>(fs::file_size(name, error))};
      if (error || !std::ifstream(name, std::ios::binary)) {
        ringattn::detail::fail_as(ErrorKind::io, "ringattn-data", "input '", name,
                                  "' cannot be read", error ? ": " + error.message() : "");
      }
      input.val_bytes = static_cast<std::int64_t>(std::floor(input.bytes * val_fraction));
      total += input.bytes;
      val_total += input.val_bytes;
      inputs.push_back(input);
    }
    const std::int64_t train_total = total - val_total;
    if (train_total == 0) {
      ringattn::detail::fail("ringattn-data", "the inputs hold no training bytes (", total,
                             " bytes in all)");
    }
    if (val_fraction > 0.0 && val_total == 0) {
      ringattn::detail::fail("ringattn-data", "the validation split is empty: ", total,
                             " bytes at --val-fraction ", val_fraction,
                             " give no byte per file; give more text or --val-fraction 0");
    }

    const fs::path train_path = output_path(out, "train"), val_path = output_path(out, "val");
    if (train_path.has_parent_path()) {
      std::error_code error;
      fs::create_directories(train_path.parent_path(), error);
      if (error) {
        ringattn::detail::fail_as(ErrorKind::io, "ringattn-data", "--out '", out,
                                  "': cannot create the directory '",
                                  train_path.parent_path().string(), "': ", error.message());
      }
    }
    for (const fs::path& path : {train_path, val_path}) {
      if (path == val_path && val_total == 0) continue;
      if (const std::string problem = ringattn::tools::unwritable("--out", path.string());
          !problem.empty()) {
        ringattn::detail::fail_as(ErrorKind::io, "ringattn-data", problem);
      }
    }
    TokenDatasetWriter train(train_path, train_total, kByteVocab, "byte");
    if (eod_token >= 0) train.end_documents_at(eod_token);
    for (const Input& input : inputs) {
      train.start_document();
      copy_bytes(input, 0, input.bytes - input.val_bytes, train);
    }
    train.finish();
    std::size_t val_documents = 0;
    if (val_total > 0) {
      TokenDatasetWriter val(val_path, val_total, kByteVocab, "byte");
      if (eod_token >= 0) val.end_documents_at(eod_token);
      for (const Input& input : inputs) {
        val.start_document();
        copy_bytes(input, input.bytes - input.val_bytes, input.bytes, val);
      }
      val.finish();
      val_documents = val.document_starts().size();
    }

    std::printf("ringattn-data: %zu file%s, %lld bytes -> byte tokens (vocab %d, uint16)\n",
                inputs.size(), inputs.size() == 1 ? "" : "s", static_cast<long long>(total),
                kByteVocab);
    std::printf("  train  %-40s %12lld tokens %9zu documents\n", train_path.c_str(),
                static_cast<long long>(train_total), train.document_starts().size());
    if (val_total > 0) {
      std::printf("  val    %-40s %12lld tokens %9zu documents\n", val_path.c_str(),
                  static_cast<long long>(val_total), val_documents);
    }
    std::printf("use with: --set data.source=hdf5 --set data.train_path=%s%s%s\n",
                train_path.c_str(), val_total > 0 ? " --set data.val_path=" : "",
                val_total > 0 ? val_path.c_str() : "");
    return 0;
  } catch (const ringattn::Error& e) {
    // Errors raised here already begin with "ringattn-data: ".
    std::fprintf(stderr, "%s%s\n", e.where() == "ringattn-data" ? "" : "ringattn-data: ", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(
        stderr,
        "ringattn-data: out of host memory (std::bad_alloc) converting %zu file%s to '%s'\n",
        files.size(), files.size() == 1 ? "" : "s", out.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ringattn-data: %s\n", e.what());
    return 1;
  }
}
