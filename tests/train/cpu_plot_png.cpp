// The PNG plots: every file is read back by a decoder of this test's own (chunk CRCs by the bitwise
// CRC-32, IHDR, the zlib header, stored blocks, Adler-32, filter-0 rows), never by the encoder's
// code; then pixels are checked against the plot-area mapping that train/plot_png.hpp documents:
// a line lands where its data maps, nothing else carries its colour, a non-finite point leaves a
// gap, an empty panel says "no data", a metrics.jsonl gives three panels with its values in them.
// Malformed metrics lines and bad arguments give errors naming the file and line, or the argument.
#include "train/plot_png.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iterator>
#include <limits>
#include <ostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/train/expect_error.hpp"
#include "tests/train/temp_dir.hpp"

namespace ringattn::train {

void PrintTo(const Rgb& c, std::ostream* out) {
  *out << "rgb(" << int{c.r} << ", " << int{c.g} << ", " << int{c.b} << ")";
}

namespace {

using test::throws_error_with;

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// An independent PNG reader for what the encoder promises: 8-bit RGB, stored deflate blocks,
// filter 0. Anything else is a failure (std::runtime_error, which gtest reports with its text).

struct Decoded {
  int width = 0, height = 0;
  std::vector<Rgb> pixels;
  Rgb at(int x, int y) const { return pixels.at(static_cast<std::size_t>(y) * width + x); }
};

std::uint32_t bitwise_crc32(const std::uint8_t* data, std::size_t size) {
  std::uint32_t crc = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i) {
    crc ^= data[i];
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0xEDB88320u & (0u - (crc & 1u)));
  }
  return ~crc;
}

std::uint32_t read_be32(const std::vector<std::uint8_t>& bytes, std::size_t at) {
  if (at + 4 > bytes.size()) throw std::runtime_error("truncated at byte " + std::to_string(at));
  return std::uint32_t{bytes[at]} << 24 | std::uint32_t{bytes[at + 1]} << 16 |
         std::uint32_t{bytes[at + 2]} << 8 | bytes[at + 3];
}

void require(bool condition, const std::string& what) {
  if (!condition) throw std::runtime_error("PNG: " + what);
}

Decoded decode_png(const std::vector<std::uint8_t>& file) {
  const std::vector<std::uint8_t> signature = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  require(file.size() >= 8 && std::equal(signature.begin(), signature.end(), file.begin()),
          "bad signature");
  Decoded image;
  std::vector<std::uint8_t> zlib;
  bool seen_header = false, seen_end = false;
  for (std::size_t at = 8; at < file.size();) {
    require(!seen_end, "bytes after IEND");
    const std::uint32_t length = read_be32(file, at);
    require(at + 12 + length <= file.size(), "chunk runs past the end of the file");
    const std::string type(file.begin() + at + 4, file.begin() + at + 8);
    const std::uint8_t* data = file.data() + at + 8;
    require(bitwise_crc32(file.data() + at + 4, length + 4) == read_be32(file, at + 8 + length),
            "CRC mismatch in " + type);
    require(seen_header || type == "IHDR", "first chunk is " + type);
    if (type == "IHDR") {
      require(!seen_header && length == 13, "IHDR twice or of length " + std::to_string(length));
      const std::vector<std::uint8_t> ihdr(data, data + 13);
      image.width = static_cast<int>(read_be32(ihdr, 0));
      image.height = static_cast<int>(read_be32(ihdr, 4));
      require(image.width > 0 && image.height > 0, "empty image");
      require(ihdr[8] == 8 && ihdr[9] == 2, "not 8-bit RGB");
      require(ihdr[10] == 0 && ihdr[11] == 0 && ihdr[12] == 0,
              "compression, filter method or interlace not 0");
      seen_header = true;
    } else if (type == "IDAT") {
      zlib.insert(zlib.end(), data, data + length);
    } else if (type == "IEND") {
      require(length == 0, "IEND has data");
      seen_end = true;
    }
    at += 12 + length;
  }
  require(seen_end, "no IEND");

  require(zlib.size() >= 6, "zlib stream too short");
  const unsigned cmf = zlib[0], flg = zlib[1];
  require((cmf & 0x0F) == 8 && (cmf >> 4) <= 7, "zlib method is not deflate with window <= 32K");
  require((cmf * 256 + flg) % 31 == 0, "zlib header check bits wrong");
  require((flg & 0x20) == 0, "zlib preset dictionary");
  std::vector<std::uint8_t> raw;
  std::size_t at = 2;
  for (bool final = false; !final;) {
    // Every block starts on a byte boundary, since all blocks are stored: bit 0 BFINAL, bits 1-2
    // BTYPE, the rest padding.
    require(at + 5 <= zlib.size(), "truncated deflate block header");
    final = zlib[at] & 1;
    require(((zlib[at] >> 1) & 3) == 0, "a deflate block that is not stored");
    const unsigned len = zlib[at + 1] | zlib[at + 2] << 8, nlen = zlib[at + 3] | zlib[at + 4] << 8;
    require((len ^ 0xFFFFu) == nlen, "LEN and NLEN disagree");
    at += 5;
    require(at + len <= zlib.size(), "stored block runs past the stream");
    raw.insert(raw.end(), zlib.begin() + at, zlib.begin() + at + len);
    at += len;
  }
  std::uint32_t a = 1, b = 0;
  for (const std::uint8_t byte : raw) {
    a = (a + byte) % 65521;
    b = (b + a) % 65521;
  }
  require(read_be32(zlib, at) == (b << 16 | a), "Adler-32 mismatch");
  require(at + 4 == zlib.size(), "bytes after the Adler-32");

  const std::size_t stride = 1 + 3 * static_cast<std::size_t>(image.width);
  require(raw.size() == stride * image.height, "inflated size " + std::to_string(raw.size()) +
                                                   ", expected " +
                                                   std::to_string(stride * image.height));
  for (int y = 0; y < image.height; ++y) {
    const std::uint8_t* row = raw.data() + y * stride;
    require(row[0] == 0, "row " + std::to_string(y) + " has filter " + std::to_string(row[0]));
    for (int x = 0; x < image.width; ++x) {
      image.pixels.push_back({row[1 + 3 * x], row[2 + 3 * x], row[3 + 3 * x]});
    }
  }
  return image;
}

Decoded read_png(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path.string());
  return decode_png(std::vector<std::uint8_t>(std::istreambuf_iterator<char>(in), {}));
}

// ---------------------------------------------------------------------------------------------
// The documented mapping from data to pixels, written out here again.

struct Map {
  PlotArea a;
  double x0, x1, y0, y1;
  double column(double x) const { return a.left + (x - x0) / (x1 - x0) * (a.width - 1); }
  double row(double y) const {
    return a.top + a.height - 1 - (y - y0) / (y1 - y0) * (a.height - 1);
  }
  int px(double x) const { return static_cast<int>(std::lround(column(x))); }
  int py(double y) const { return static_cast<int>(std::lround(row(y))); }
};

double distance_to_segment(double px, double py, double ax, double ay, double bx, double by) {
  const double dx = bx - ax, dy = by - ay;
  const double t = std::clamp(((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy), 0.0, 1.0);
  return std::hypot(px - (ax + t * dx), py - (ay + t * dy));
}

bool is_series_colour(Rgb c) {
  return std::find(kSeriesColours.begin(), kSeriesColours.end(), c) != kSeriesColours.end();
}

std::uint32_t fresh_seed() {
  return std::random_device{}();
}

// ---------------------------------------------------------------------------------------------

TEST(PlotPng, EncodesEveryPixel) {
  const std::uint32_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  // 1456 x 15 is exactly 65535 bytes of rows (one full stored block), 1456 x 30 exactly two.
  const std::pair<int, int> sizes[] = {{1, 1}, {3, 2}, {1456, 15}, {1456, 30}, {201, 150}};
  for (const auto& [width, height] : sizes) {
    SCOPED_TRACE(std::to_string(width) + "x" + std::to_string(height));
    Image image(width, height);
    for (int y = 0; y < height; ++y) {
      for (int x = 0; x < width; ++x) {
        image.set(x, y,
                  Rgb{static_cast<std::uint8_t>(rng()), static_cast<std::uint8_t>(rng()),
                      static_cast<std::uint8_t>(rng())});
      }
    }
    const Decoded decoded = decode_png(encode_png(image));
    ASSERT_EQ(decoded.width, width);
    ASSERT_EQ(decoded.height, height);
    int wrong = 0;
    for (int y = 0; y < height; ++y) {
      for (int x = 0; x < width; ++x) wrong += decoded.at(x, y) != image.at(x, y);
    }
    EXPECT_EQ(wrong, 0);
  }
}

TEST(PlotPng, WritesAtomically) {
  const test::TempDir dir;
  write_png(dir / "a.png", Image(4, 3, Rgb{1, 2, 3}));
  EXPECT_FALSE(std::filesystem::exists(dir / "a.png.tmp"));
  const Decoded decoded = read_png(dir / "a.png");
  EXPECT_EQ(decoded.width, 4);
  EXPECT_EQ(decoded.at(3, 2), (Rgb{1, 2, 3}));
  EXPECT_TRUE(throws_error_with([&] { write_png(dir / "missing" / "b.png", Image(1, 1)); },
                                {"b.png.tmp"}, ErrorKind::io));
}

// A straight line y = 1 + 0.8 x in the middle one of three panels: every data point's pixel has
// the series colour, the rest of the line is within reach of the 2 px pen, and no pixel farther
// than 2.5 px from the line (or outside the panel's plot area) has any series colour.
TEST(PlotPng, LineLandsWhereItsDataMaps) {
  PlotSeries line;
  for (int i = 0; i <= 10; ++i) {
    line.x.push_back(i);
    line.y.push_back(1.0 + 0.8 * i);
  }
  PlotPanel panel{"line", "x", "y", {line}, std::pair{0.0, 10.0}, std::pair{0.0, 10.0}};
  const test::TempDir dir;
  write_plot_png(dir / "line.png", {PlotPanel{}, panel, PlotPanel{}});
  const Decoded image = read_png(dir / "line.png");
  ASSERT_EQ(image.width, 3 * kPanelWidth);
  ASSERT_EQ(image.height, kPanelHeight);

  const Map map{plot_area(1), 0.0, 10.0, 0.0, 10.0};
  const Rgb colour = kSeriesColours[0];
  // The pen covers the point's pixel and those right of and below it; the line rises to the
  // right, so the pixel above a point stays clear: this pins the row, not just its neighbourhood.
  for (std::size_t i = 0; i < line.x.size(); ++i) {
    const int x = map.px(line.x[i]), y = map.py(line.y[i]);
    EXPECT_EQ(image.at(x, y), colour) << "point " << i;
    EXPECT_NE(image.at(x, y - 1), colour) << "above point " << i;
  }
  for (double x = 0.0; x <= 10.0; x += 0.01) {
    const int cx = map.px(x), cy = map.py(1.0 + 0.8 * x);
    bool near = false;
    for (int dy = -1; dy <= 1; ++dy) {
      for (int dx = -1; dx <= 1; ++dx) near |= image.at(cx + dx, cy + dy) == colour;
    }
    EXPECT_TRUE(near) << "no line near x = " << x;
  }
  const double ax = map.column(0.0), ay = map.row(1.0), bx = map.column(10.0), by = map.row(9.0);
  int stray = 0, white = 0;
  for (int y = 0; y < image.height; ++y) {
    for (int x = 0; x < image.width; ++x) {
      const Rgb c = image.at(x, y);
      const bool in_area = x >= map.a.left && x < map.a.left + map.a.width && y >= map.a.top &&
                           y < map.a.top + map.a.height;
      const bool far = distance_to_segment(x, y, ax, ay, bx, by) > 2.5;
      if (is_series_colour(c) && (far || !in_area)) ++stray;
      if (in_area && far) {
        EXPECT_TRUE(c == kBackground || c == kGridColour) << "pixel " << x << "," << y;
        white += c == kBackground;
      }
    }
  }
  EXPECT_EQ(stray, 0);
  EXPECT_GT(white, map.a.width * map.a.height / 2);  // the grid is sparse, the rest background
}

TEST(PlotPng, NonFiniteValuesLeaveGaps) {
  PlotSeries line;
  for (int i = 0; i <= 10; ++i) {
    line.x.push_back(i);
    line.y.push_back(i);
  }
  line.y[3] = kNan;
  line.x[7] = std::numeric_limits<double>::infinity();
  PlotPanel panel{"gaps", "", "", {line}, std::pair{0.0, 10.0}, std::pair{0.0, 10.0}};
  const test::TempDir dir;
  write_plot_png(dir / "gaps.png", {panel});
  const Decoded image = read_png(dir / "gaps.png");
  const Map map{plot_area(0), 0.0, 10.0, 0.0, 10.0};
  const Rgb colour = kSeriesColours[0];
  for (const int i : {0, 2, 4, 6, 8, 10}) {
    EXPECT_EQ(image.at(map.px(i), map.py(i)), colour) << "point " << i;
  }
  for (const auto& [from, to] : {std::pair{2, 4}, std::pair{6, 8}}) {
    int painted = 0;
    for (int x = map.px(from) + 3; x <= map.px(to) - 3; ++x) {
      for (int y = map.a.top; y < map.a.top + map.a.height; ++y) {
        painted += image.at(x, y) == colour;
      }
    }
    EXPECT_EQ(painted, 0) << "between points " << from << " and " << to;
  }
}

TEST(PlotPng, MarkersAreDiscsOnThePoints) {
  PlotSeries dots{"", {2.0, 8.0}, {5.0, 5.0}, true};
  PlotPanel panel{"", "", "", {dots}, std::pair{0.0, 10.0}, std::pair{0.0, 10.0}};
  const Decoded image = decode_png(encode_png(render_plot({panel})));
  const Map map{plot_area(0), 0.0, 10.0, 0.0, 10.0};
  // The disc's edges on the side away from the line pin its centre in both directions.
  for (const auto& [x, outward] : {std::pair{2.0, -1}, std::pair{8.0, 1}}) {
    const int cx = map.px(x), cy = map.py(5.0);
    EXPECT_EQ(image.at(cx, cy - kMarkerRadius), kSeriesColours[0]);
    EXPECT_EQ(image.at(cx, cy + kMarkerRadius), kSeriesColours[0]);
    EXPECT_EQ(image.at(cx + outward * kMarkerRadius, cy), kSeriesColours[0]);
    EXPECT_FALSE(is_series_colour(image.at(cx, cy - kMarkerRadius - 1)));
    EXPECT_FALSE(is_series_colour(image.at(cx, cy + kMarkerRadius + 1)));
    EXPECT_FALSE(is_series_colour(image.at(cx + outward * (kMarkerRadius + 1), cy)));
  }
}

TEST(PlotPng, PanelWithoutDataSaysSo) {
  PlotSeries empty{"empty", {}, {}}, all_nan{"nan", {1.0, 2.0}, {kNan, kNan}, true};
  PlotPanel panel;
  panel.title = "nothing here";
  panel.series = {empty, all_nan};
  const Decoded image = decode_png(encode_png(render_plot({panel})));
  ASSERT_EQ(image.width, kPanelWidth);
  const PlotArea a = plot_area(0);
  int series = 0, ink_in_middle = 0;
  for (int y = 0; y < image.height; ++y) {
    for (int x = 0; x < image.width; ++x) {
      series += is_series_colour(image.at(x, y));
      const bool middle =
          std::abs(x - (a.left + a.width / 2)) < 60 && std::abs(y - (a.top + a.height / 2)) < 12;
      ink_in_middle += middle && image.at(x, y) == kInkColour;
    }
  }
  EXPECT_EQ(series, 0) << "no data, no legend";
  EXPECT_GT(ink_in_middle, 30) << "\"no data\" in the middle of the plot area";
}

// 40 training steps (loss 6 -> 2, one null; tokens/s 1010 -> 1400) and 4 evaluations: the panels
// hold these values, and they land on the pixels that the documented ranges give.
TEST(PlotPng, MetricsFileGivesThreePanels) {
  const test::TempDir dir;
  {
    std::ofstream out(dir / "metrics.jsonl");
    for (int step = 1; step <= 40; ++step) {
      out << "{\"step\": " << step << ", \"loss\": ";
      if (step == 25) {
        out << "null";
      } else {
        out << 6.0 - 4.0 * (step - 1) / 39.0;
      }
      out << ", \"lr\": 0.001, \"tokens_per_s\": " << 1000 + 10 * step
          << ", \"name\": \"a\\\"b\"}\n";
      if (step % 10 == 0) {
        out << "{\"step\": " << step
            << ", \"eval_loss\": 4, \"eval_accuracy\": " << 0.3 + 0.01 * step << "}\n\n";
      }
    }
  }
  const std::vector<PlotPanel> panels = metrics_panels(dir / "metrics.jsonl");
  ASSERT_EQ(panels.size(), 3u);
  ASSERT_EQ(panels[0].series.size(), 2u);
  EXPECT_EQ(panels[0].series[0].x.size(), 40u);
  EXPECT_TRUE(std::isnan(panels[0].series[0].y[24]));
  EXPECT_DOUBLE_EQ(panels[0].series[0].y[0], 6.0);
  EXPECT_EQ(panels[0].series[1].x, (std::vector<double>{10, 20, 30, 40}));
  EXPECT_EQ(panels[1].series[0].y.size(), 4u);
  EXPECT_DOUBLE_EQ(panels[1].series[0].y[3], 0.7);
  EXPECT_EQ(panels[2].series[0].y[9], 1100.0);

  write_metrics_png(dir / "metrics.jsonl", dir / "metrics.png");
  const Decoded image = read_png(dir / "metrics.png");
  ASSERT_EQ(image.width, 3 * kPanelWidth);
  ASSERT_EQ(image.height, kPanelHeight);

  // Steps 1..40 padded by 5% of 39; loss 2..6 padded by 5% of 4; accuracy 0..1; tokens/s
  // 1010..1400 padded by 5% of 390.
  const double x0 = 1 - 1.95, x1 = 40 + 1.95;
  const Map loss{plot_area(0), x0, x1, 2 - 0.2, 6 + 0.2};
  const Map accuracy{plot_area(1), x0, x1, 0.0, 1.0};
  const Map speed{plot_area(2), x0, x1, 1010 - 19.5, 1400 + 19.5};
  for (const int step : {10, 20, 30, 40}) {
    EXPECT_EQ(image.at(loss.px(step), loss.py(4.0)), kSeriesColours[1]) << "eval loss " << step;
    EXPECT_EQ(image.at(accuracy.px(step), accuracy.py(0.3 + 0.01 * step)), kSeriesColours[0])
        << "accuracy " << step;
  }
  for (int step = 10; step <= 30; ++step) {
    EXPECT_EQ(image.at(speed.px(step), speed.py(1000 + 10 * step)), kSeriesColours[0])
        << "tokens/s " << step;
  }
  int painted = 0;  // the null loss at step 25
  for (int x = loss.px(24) + 3; x <= loss.px(26) - 3; ++x) {
    for (int y = loss.a.top; y < loss.a.top + loss.a.height; ++y) {
      painted += image.at(x, y) == kSeriesColours[0];
    }
  }
  EXPECT_EQ(painted, 0);
}

TEST(PlotPng, MalformedMetricsNameFileAndLine) {
  const test::TempDir dir;
  const std::string good = "{\"step\": 1, \"loss\": 2.5}\n";
  const std::pair<std::string, std::string> cases[] = {
      {good + good + "{\"step\": 3, \"loss\": }\n", ":3: expected a number"},
      {good + "{\"loss\": 1.0}\n", ":2: no \"step\""},
      {"{\"step\": 1} x\n", ":1: unexpected text"},
      {good + "\n{\"step\": 1, \"loss\": 2.0\n", ":3: expected '}'"},
      {"{\"step\": 1, \"a\": [1]}\n", ":1: expected a number"},
      {"{\"step\": 1, \"name\": \"abc}\n", ":1: unterminated string"},
      {"[1, 2]\n", ":1: expected '{'"},
  };
  for (const auto& [text, part] : cases) {
    const std::filesystem::path path = dir / "metrics.jsonl";
    std::ofstream(path) << text;
    EXPECT_TRUE(
        throws_error_with([&] { metrics_panels(path); }, {path.string(), part}, ErrorKind::io))
        << text;
  }
  EXPECT_TRUE(throws_error_with([&] { write_metrics_png(dir / "none.jsonl", dir / "none.png"); },
                                {"none.jsonl"}, ErrorKind::io));
}

TEST(PlotPng, BadArgumentsAreNamed) {
  PlotPanel panel;
  panel.title = "p";
  panel.series = {PlotSeries{"s", {1.0, 2.0}, {1.0}}};
  EXPECT_TRUE(throws_error_with([&] { render_plot({panel}); }, {"series 's'", "2 x values"},
                                ErrorKind::invalid_argument));
  panel.series.clear();
  panel.y_range = std::pair{1.0, 1.0};
  EXPECT_TRUE(throws_error_with([&] { render_plot({panel}); }, {"y_range"}));
  panel.y_range.reset();
  panel.x_range = std::pair{0.0, kNan};
  EXPECT_TRUE(throws_error_with([&] { render_plot({panel}); }, {"x_range"}));
}

}  // namespace
}  // namespace ringattn::train
