#include "train/plot_png.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <string_view>

#include "ringattn/error.hpp"
#include "train/atomic_file.hpp"

namespace ringattn::train {
namespace {

// ---------------------------------------------------------------------------------------------
// PNG

std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t n = 0; n < 256; ++n) {
    std::uint32_t c = n;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
    table[n] = c;
  }
  return table;
}

std::uint32_t crc32(const std::uint8_t* data, std::size_t size) {
  static const std::array<std::uint32_t, 256> table = make_crc_table();
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::size_t i = 0; i < size; ++i) c = table[(c ^ data[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t adler32(const std::vector<std::uint8_t>& data) {
  // 5552 is the most bytes whose sums cannot overflow 32 bits before the modulo (zlib's NMAX).
  constexpr std::uint32_t kMod = 65521;
  std::uint32_t a = 1, b = 0;
  for (std::size_t start = 0; start < data.size(); start += 5552) {
    const std::size_t end = std::min(data.size(), start + 5552);
    for (std::size_t i = start; i < end; ++i) {
      a += data[i];
      b += a;
    }
    a %= kMod;
    b %= kMod;
  }
  return (b << 16) | a;
}

void put_u32(std::vector<std::uint8_t>& out, std::uint32_t value) {
  for (int shift = 24; shift >= 0; shift -= 8) {
    out.push_back(static_cast<std::uint8_t>(value >> shift));
  }
}

void put_chunk(std::vector<std::uint8_t>& out, const char (&type)[5],
               const std::vector<std::uint8_t>& data) {
  put_u32(out, static_cast<std::uint32_t>(data.size()));
  const std::size_t crc_start = out.size();
  out.insert(out.end(), type, type + 4);
  out.insert(out.end(), data.begin(), data.end());
  put_u32(out, crc32(out.data() + crc_start, out.size() - crc_start));
}

// ---------------------------------------------------------------------------------------------
// Font: 5 columns (bit 4 is the leftmost) by 9 rows; capitals sit on rows 0-6, descenders use
// rows 7-8. A character advances 6 columns; characters without a glyph draw as '?'.

constexpr int kGlyphRows = 9, kGlyphAdvance = 6;

struct Glyph {
  char c;
  std::array<std::uint8_t, kGlyphRows> rows;
};

constexpr Glyph kGlyphs[] = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E, 0x00, 0x00}},
    {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F, 0x00, 0x00}},
    {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E, 0x00, 0x00}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02, 0x00, 0x00}},
    {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E, 0x00, 0x00}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E, 0x00, 0x00}},
    {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08, 0x00, 0x00}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E, 0x00, 0x00}},
    {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C, 0x00, 0x00}},
    {'A', {0x0E, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00, 0x00}},
    {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E, 0x00, 0x00}},
    {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E, 0x00, 0x00}},
    {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C, 0x00, 0x00}},
    {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F, 0x00, 0x00}},
    {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10, 0x00, 0x00}},
    {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F, 0x00, 0x00}},
    {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11, 0x00, 0x00}},
    {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}},
    {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C, 0x00, 0x00}},
    {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11, 0x00, 0x00}},
    {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F, 0x00, 0x00}},
    {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11, 0x00, 0x00}},
    {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11, 0x00, 0x00}},
    {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}},
    {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10, 0x00, 0x00}},
    {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D, 0x00, 0x00}},
    {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11, 0x00, 0x00}},
    {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E, 0x00, 0x00}},
    {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}},
    {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}},
    {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00, 0x00}},
    {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A, 0x00, 0x00}},
    {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11, 0x00, 0x00}},
    {'Y', {0x11, 0x11, 0x0A, 0x04, 0x04, 0x04, 0x04, 0x00, 0x00}},
    {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F, 0x00, 0x00}},
    {'a', {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F, 0x00, 0x00}},
    {'b', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E, 0x00, 0x00}},
    {'c', {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E, 0x00, 0x00}},
    {'d', {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F, 0x00, 0x00}},
    {'e', {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E, 0x00, 0x00}},
    {'f', {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08, 0x00, 0x00}},
    {'g', {0x00, 0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x11, 0x0E}},
    {'h', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00}},
    {'i', {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}},
    {'j', {0x02, 0x00, 0x06, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}},
    {'k', {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12, 0x00, 0x00}},
    {'l', {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E, 0x00, 0x00}},
    {'m', {0x00, 0x00, 0x1A, 0x15, 0x15, 0x15, 0x15, 0x00, 0x00}},
    {'n', {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11, 0x00, 0x00}},
    {'o', {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E, 0x00, 0x00}},
    {'p', {0x00, 0x00, 0x1E, 0x11, 0x11, 0x11, 0x1E, 0x10, 0x10}},
    {'q', {0x00, 0x00, 0x0F, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x01}},
    {'r', {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10, 0x00, 0x00}},
    {'s', {0x00, 0x00, 0x0F, 0x10, 0x0E, 0x01, 0x1E, 0x00, 0x00}},
    {'t', {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06, 0x00, 0x00}},
    {'u', {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D, 0x00, 0x00}},
    {'v', {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04, 0x00, 0x00}},
    {'w', {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A, 0x00, 0x00}},
    {'x', {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x00, 0x00}},
    {'y', {0x00, 0x00, 0x11, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E}},
    {'z', {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F, 0x00, 0x00}},
    {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C, 0x00, 0x00}},
    {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08, 0x00, 0x00}},
    {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00, 0x00, 0x00}},
    {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00, 0x00, 0x00}},
    {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00, 0x00, 0x00}},
    {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00, 0x00, 0x00}},
    {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03, 0x00, 0x00}},
    {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02, 0x00, 0x00}},
    {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08, 0x00, 0x00}},
    {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00, 0x00, 0x00}},
    {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F, 0x00, 0x00}},
    {'?', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04, 0x00, 0x00}},
};

const std::array<std::uint8_t, kGlyphRows>* glyph(char c) {
  if (c == ' ') return nullptr;
  for (const Glyph& g : kGlyphs) {
    if (g.c == c) return &g.rows;
  }
  return glyph('?');
}

int text_width(std::string_view text, int scale) {
  return text.empty() ? 0 : static_cast<int>(text.size()) * kGlyphAdvance * scale - scale;
}

// (x, y) is the top left of the first glyph; rotated text reads bottom to top and (x, y) is then
// its bottom left.
void draw_text(Image& image, int x, int y, std::string_view text, int scale, bool rotated = false,
               Rgb colour = kInkColour) {
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto* rows = glyph(text[i]);
    if (rows == nullptr) continue;
    for (int row = 0; row < kGlyphRows; ++row) {
      for (int column = 0; column < 5; ++column) {
        if (((*rows)[row] >> (4 - column) & 1) == 0) continue;
        const int along = (static_cast<int>(i) * kGlyphAdvance + column) * scale;
        for (int dy = 0; dy < scale; ++dy) {
          for (int dx = 0; dx < scale; ++dx) {
            if (rotated) {
              image.set(x + row * scale + dy, y - along - dx, colour);
            } else {
              image.set(x + along + dx, y + row * scale + dy, colour);
            }
          }
        }
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Drawing

void fill_rect(Image& image, int left, int top, int width, int height, Rgb colour) {
  for (int y = top; y < top + height; ++y) {
    for (int x = left; x < left + width; ++x) image.set(x, y, colour);
  }
}

void outline_rect(Image& image, int left, int top, int width, int height, Rgb colour) {
  fill_rect(image, left, top, width, 1, colour);
  fill_rect(image, left, top + height - 1, width, 1, colour);
  fill_rect(image, left, top, 1, height, colour);
  fill_rect(image, left + width - 1, top, 1, height, colour);
}

bool inside(const PlotArea& a, int x, int y) {
  return x >= a.left && y >= a.top && x < a.left + a.width && y < a.top + a.height;
}

// Liang-Barsky: shortens the segment to its part within `a`; false when nothing is left. Done in
// doubles before rounding so that points far off the axes (a spike, a range set by the caller)
// cannot overflow int or make Bresenham walk millions of pixels.
bool clip_segment(const PlotArea& a, double& x0, double& y0, double& x1, double& y1) {
  const double dx = x1 - x0, dy = y1 - y0;
  const double p[4] = {-dx, dx, -dy, dy};
  const double q[4] = {x0 - a.left, a.left + a.width - 1 - x0, y0 - a.top,
                       a.top + a.height - 1 - y0};
  double t0 = 0.0, t1 = 1.0;
  for (int k = 0; k < 4; ++k) {
    if (p[k] == 0.0) {
      if (q[k] < 0.0) return false;
      continue;
    }
    const double t = q[k] / p[k];
    if (p[k] < 0.0) {
      t0 = std::max(t0, t);
    } else {
      t1 = std::min(t1, t);
    }
  }
  if (t0 > t1) return false;
  x1 = x0 + t1 * dx;
  y1 = y0 + t1 * dy;
  x0 += t0 * dx;
  y0 += t0 * dy;
  return true;
}

void draw_line(Image& image, const PlotArea& a, double fx0, double fy0, double fx1, double fy1,
               Rgb colour) {
  // Non-finite only where data near the limits of double overflows the mapping.
  if (!std::isfinite(fx0 + fy0 + fx1 + fy1) || !clip_segment(a, fx0, fy0, fx1, fy1)) return;
  int x0 = static_cast<int>(std::lround(fx0)), y0 = static_cast<int>(std::lround(fy0));
  const int x1 = static_cast<int>(std::lround(fx1)), y1 = static_cast<int>(std::lround(fy1));
  const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
  const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
  for (int error = dx + dy;;) {
    for (int k = 0; k < 4; ++k) {
      if (inside(a, x0 + k % 2, y0 + k / 2)) image.set(x0 + k % 2, y0 + k / 2, colour);
    }
    if (x0 == x1 && y0 == y1) break;
    const int twice = 2 * error;
    if (twice >= dy) {
      error += dy;
      x0 += sx;
    }
    if (twice <= dx) {
      error += dx;
      y0 += sy;
    }
  }
}

void draw_marker(Image& image, const PlotArea& a, double fx, double fy, Rgb colour) {
  if (!std::isfinite(fx + fy) || fx < a.left - kMarkerRadius ||
      fx > a.left + a.width + kMarkerRadius || fy < a.top - kMarkerRadius ||
      fy > a.top + a.height + kMarkerRadius) {
    return;
  }
  const int cx = static_cast<int>(std::lround(fx)), cy = static_cast<int>(std::lround(fy));
  for (int dy = -kMarkerRadius; dy <= kMarkerRadius; ++dy) {
    for (int dx = -kMarkerRadius; dx <= kMarkerRadius; ++dx) {
      if (dx * dx + dy * dy <= kMarkerRadius * kMarkerRadius + 1 && inside(a, cx + dx, cy + dy)) {
        image.set(cx + dx, cy + dy, colour);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Axes

using Range = std::pair<double, double>;

std::optional<Range> padded_range(const std::vector<PlotSeries>& series, bool use_x) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const PlotSeries& s : series) {
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.x[i]) || !std::isfinite(s.y[i])) continue;
      const double v = use_x ? s.x[i] : s.y[i];
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  }
  if (lo > hi) return std::nullopt;
  const double pad = hi > lo ? 0.05 * (hi - lo) : lo != 0.0 ? 0.05 * std::abs(lo) : 1.0;
  return Range{lo - pad, hi + pad};
}

void check_range(const std::optional<Range>& range, const char* name) {
  if (range && !(std::isfinite(range->first) && std::isfinite(range->second) &&
                 range->first < range->second)) {
    detail::fail("render_plot", "PlotPanel::", name, " is (", range->first, ", ", range->second,
                 "); expected finite numbers with first < second");
  }
}

struct Ticks {
  std::vector<double> values;
  std::vector<std::string> labels;
  int widest_px = 0;
};

// Steps of 1, 2 or 5 times a power of ten, about `target` of them across [lo, hi]; labels share
// one suffix (k, M, G) and as many decimals as the step needs.
Ticks make_ticks(Range range, int target) {
  Ticks ticks;
  const auto [lo, hi] = range;
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / magnitude;
  const double step = (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
  if (!std::isfinite(step) || step <= 0.0) return ticks;
  // The cap stops the loop where k is too large for ++k to change it (a narrow range far from 0).
  for (double k = std::ceil(lo / step - 1e-9);
       k * step <= hi + 1e-9 * step && ticks.values.size() < 20; ++k) {
    ticks.values.push_back(std::abs(k) < 0.5 ? 0.0 : k * step);  // no "-0"
  }
  const double largest = std::max(std::abs(lo), std::abs(hi));
  const auto [unit, suffix] = largest >= 1e9   ? std::pair{1e9, "G"}
                              : largest >= 1e6 ? std::pair{1e6, "M"}
                              : largest >= 1e4 ? std::pair{1e3, "k"}
                                               : std::pair{1.0, ""};
  const int decimals =
      std::clamp(static_cast<int>(std::ceil(-std::log10(step / unit) - 1e-9)), 0, 9);
  for (const double value : ticks.values) {
    char text[48];
    std::snprintf(text, sizeof text, "%.*f%s", decimals, value / unit, value == 0.0 ? "" : suffix);
    ticks.labels.push_back(text);
    ticks.widest_px = std::max(ticks.widest_px, text_width(text, 1));
  }
  return ticks;
}

struct Mapping {
  PlotArea a;
  Range x, y;
  double column(double v) const {
    return a.left + (v - x.first) / (x.second - x.first) * (a.width - 1);
  }
  double row(double v) const {
    return a.top + a.height - 1 - (v - y.first) / (y.second - y.first) * (a.height - 1);
  }
};

// Counts series pixels under a candidate legend box, to put the legend where it hides least.
int covered_pixels(const Image& image, int left, int top, int width, int height) {
  int count = 0;
  for (int y = top; y < top + height; ++y) {
    for (int x = left; x < left + width; ++x) {
      const Rgb c = image.at(x, y);
      count += c != kBackground && c != kGridColour;
    }
  }
  return count;
}

void draw_legend(Image& image, const PlotArea& a, const std::vector<PlotSeries>& series) {
  struct Entry {
    const PlotSeries* s;
    Rgb colour;
  };
  std::vector<Entry> entries;
  int widest = 0;
  for (std::size_t i = 0; i < series.size(); ++i) {
    if (series[i].name.empty()) continue;
    entries.push_back({&series[i], kSeriesColours[i % kSeriesColours.size()]});
    widest = std::max(widest, text_width(series[i].name, 1));
  }
  if (entries.empty()) return;
  constexpr int kPad = 6, kSample = 20, kRow = 13, kInset = 8;
  const int width = kPad + kSample + kPad + widest + kPad;
  const int height = kPad + static_cast<int>(entries.size()) * kRow - 4 + kPad;
  const int right = a.left + a.width - kInset - width, bottom = a.top + a.height - kInset - height;
  // matplotlib's order of preference when places tie: upper right, upper left, lower left, lower
  // right.
  const std::pair<int, int> corners[] = {{right, a.top + kInset},
                                         {a.left + kInset, a.top + kInset},
                                         {a.left + kInset, bottom},
                                         {right, bottom}};
  auto best = corners[0];
  int best_count = std::numeric_limits<int>::max();
  for (const auto& corner : corners) {
    const int count = covered_pixels(image, corner.first, corner.second, width, height);
    if (count < best_count) {
      best = corner;
      best_count = count;
    }
  }
  const auto [left, top] = best;
  fill_rect(image, left, top, width, height, kBackground);
  outline_rect(image, left, top, width, height, Rgb{190, 190, 190});
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const int y = top + kPad + static_cast<int>(i) * kRow;
    fill_rect(image, left + kPad, y + 3, kSample, 2, entries[i].colour);
    if (entries[i].s->markers) {
      const PlotArea everywhere{0, 0, image.width(), image.height()};
      draw_marker(image, everywhere, left + kPad + kSample / 2, y + 3.5, entries[i].colour);
    }
    draw_text(image, left + 2 * kPad + kSample, y, entries[i].s->name, 1);
  }
}

void render_panel(Image& image, std::size_t index, const PlotPanel& panel) {
  for (const PlotSeries& s : panel.series) {
    if (s.x.size() != s.y.size()) {
      detail::fail("render_plot", "series '", s.name, "' of panel '", panel.title, "' has ",
                   s.x.size(), " x values and ", s.y.size(), " y values; expected as many");
    }
  }
  check_range(panel.x_range, "x_range");
  check_range(panel.y_range, "y_range");
  const PlotArea a = plot_area(index);
  const Mapping map{
      a, panel.x_range.value_or(padded_range(panel.series, true).value_or(Range{0.0, 1.0})),
      panel.y_range.value_or(padded_range(panel.series, false).value_or(Range{0.0, 1.0}))};

  // The most x ticks, 6 at most, whose labels leave a gap between them.
  Ticks x_ticks;
  for (int target = 6; target >= 2; --target) {
    x_ticks = make_ticks(map.x, target);
    const double spacing = x_ticks.values.size() < 2
                               ? a.width
                               : map.column(x_ticks.values[1]) - map.column(x_ticks.values[0]);
    if (spacing >= x_ticks.widest_px + 12) break;
  }
  const Ticks y_ticks = make_ticks(map.y, 5);

  for (const double v : x_ticks.values) {
    const int x = static_cast<int>(std::lround(map.column(v)));
    fill_rect(image, x, a.top, 1, a.height, kGridColour);
    fill_rect(image, x, a.top + a.height, 1, 4, kInkColour);
  }
  for (const double v : y_ticks.values) {
    const int y = static_cast<int>(std::lround(map.row(v)));
    fill_rect(image, a.left, y, a.width, 1, kGridColour);
    fill_rect(image, a.left - 5, y, 4, 1, kInkColour);
  }

  bool any_data = false;
  for (std::size_t i = 0; i < panel.series.size(); ++i) {
    const PlotSeries& s = panel.series[i];
    const Rgb colour = kSeriesColours[i % kSeriesColours.size()];
    auto finite = [&](std::size_t k) { return std::isfinite(s.x[k]) && std::isfinite(s.y[k]); };
    for (std::size_t k = 0; k < s.x.size(); ++k) {
      if (!finite(k)) continue;
      any_data = true;
      if (k + 1 < s.x.size() && finite(k + 1)) {
        draw_line(image, a, map.column(s.x[k]), map.row(s.y[k]), map.column(s.x[k + 1]),
                  map.row(s.y[k + 1]), colour);
      } else if (k == 0 || !finite(k - 1)) {
        draw_line(image, a, map.column(s.x[k]), map.row(s.y[k]), map.column(s.x[k]),
                  map.row(s.y[k]), colour);  // an isolated point stays visible without markers
      }
    }
    if (s.markers) {
      for (std::size_t k = 0; k < s.x.size(); ++k) {
        if (finite(k)) draw_marker(image, a, map.column(s.x[k]), map.row(s.y[k]), colour);
      }
    }
  }

  outline_rect(image, a.left - 1, a.top - 1, a.width + 2, a.height + 2, kInkColour);
  for (std::size_t k = 0; k < x_ticks.values.size(); ++k) {
    const int x = static_cast<int>(std::lround(map.column(x_ticks.values[k])));
    draw_text(image, x - text_width(x_ticks.labels[k], 1) / 2, a.top + a.height + 7,
              x_ticks.labels[k], 1);
  }
  for (std::size_t k = 0; k < y_ticks.values.size(); ++k) {
    const int y = static_cast<int>(std::lround(map.row(y_ticks.values[k])));
    draw_text(image, a.left - 8 - text_width(y_ticks.labels[k], 1), y - 3, y_ticks.labels[k], 1);
  }
  draw_text(image, a.left + (a.width - text_width(panel.title, 2)) / 2, 8, panel.title, 2);
  draw_text(image, a.left + (a.width - text_width(panel.x_label, 1)) / 2, a.top + a.height + 24,
            panel.x_label, 1);
  // The y label stands left of the widest tick label.
  draw_text(image, a.left - 8 - y_ticks.widest_px - 8 - 9,
            a.top + (a.height + text_width(panel.y_label, 1)) / 2, panel.y_label, 1, true);
  if (any_data) {
    draw_legend(image, a, panel.series);
  } else {
    const std::string_view text = "no data";
    draw_text(image, a.left + (a.width - text_width(text, 2)) / 2, a.top + a.height / 2 - 7, text,
              2);
  }
}

// ---------------------------------------------------------------------------------------------
// metrics.jsonl: one flat object a line. Only numbers are kept (null becomes NaN); strings and
// booleans are read and dropped.

class LineParser {
 public:
  LineParser(std::string_view text, const std::filesystem::path& path, int line)
      : text_(text), path_(path), line_(line) {}

  std::map<std::string, double, std::less<>> parse() {
    std::map<std::string, double, std::less<>> values;
    expect('{');
    if (!eat('}')) {
      do {
        std::string key = parse_string();
        expect(':');
        values[std::move(key)] = parse_value();
      } while (eat(','));
      expect('}');
    }
    skip_space();
    if (at_ < text_.size()) fail("unexpected text after the object");
    return values;
  }

  [[noreturn]] void fail(std::string_view what) const {
    detail::fail_as(ErrorKind::io, "metrics_panels", path_.string(), ":", line_, ": ", what,
                    " at column ", at_ + 1);
  }

 private:
  void skip_space() {
    while (at_ < text_.size() &&
           std::string_view(" \t\r\n").find(text_[at_]) != std::string_view::npos) {
      ++at_;
    }
  }
  bool eat(char c) {
    skip_space();
    if (at_ < text_.size() && text_[at_] == c) {
      ++at_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool eat_word(std::string_view word) {
    if (text_.substr(at_, word.size()) != word) return false;
    at_ += word.size();
    return true;
  }

  std::string parse_string() {
    expect('"');
    std::string out;
    while (at_ < text_.size() && text_[at_] != '"') {
      if (text_[at_] == '\\') ++at_;  // keys that matter have no escapes; keep the escaped char
      if (at_ < text_.size()) out += text_[at_++];
    }
    if (at_ >= text_.size()) fail("unterminated string");
    ++at_;
    return out;
  }

  double parse_value() {
    skip_space();
    if (at_ < text_.size() && text_[at_] == '"') {
      parse_string();
      return std::numeric_limits<double>::quiet_NaN();
    }
    if (eat_word("null") || eat_word("true") || eat_word("false")) {
      return std::numeric_limits<double>::quiet_NaN();
    }
    double value = 0.0;
    const char* first = text_.data() + at_;
    const auto [end, error] = std::from_chars(first, text_.data() + text_.size(), value);
    if (error != std::errc() || end == first) {
      fail("expected a number, string, true, false or null");
    }
    at_ += static_cast<std::size_t>(end - first);
    return value;
  }

  std::string_view text_;
  const std::filesystem::path& path_;
  int line_;
  std::size_t at_ = 0;
};

double value_or_nan(const std::map<std::string, double, std::less<>>& values,
                    std::string_view key) {
  const auto found = values.find(key);
  return found == values.end() ? std::numeric_limits<double>::quiet_NaN() : found->second;
}

}  // namespace

Image::Image(int width, int height, Rgb fill)
    : width_(width), height_(height), pixels_(static_cast<std::size_t>(width) * height, fill) {
  if (width <= 0 || height <= 0) {
    detail::fail("Image", "size is ", width, "x", height, "; expected both positive");
  }
}

std::vector<std::uint8_t> encode_png(const Image& image) {
  const auto w = static_cast<std::uint32_t>(image.width());
  const auto h = static_cast<std::uint32_t>(image.height());
  std::vector<std::uint8_t> raw;
  raw.reserve(static_cast<std::size_t>(h) * (1 + 3 * w));
  for (int y = 0; y < image.height(); ++y) {
    raw.push_back(0);  // filter type None
    for (int x = 0; x < image.width(); ++x) {
      const Rgb c = image.at(x, y);
      raw.insert(raw.end(), {c.r, c.g, c.b});
    }
  }

  // zlib: CMF 0x78 (deflate, 32K window), FLG 0x01 makes CMF*256+FLG a multiple of 31; then
  // stored blocks (BTYPE 00: a header byte, LEN and ~LEN little-endian, the bytes), then Adler-32.
  std::vector<std::uint8_t> zlib = {0x78, 0x01};
  constexpr std::size_t kMaxStored = 65535;
  std::size_t offset = 0;
  do {
    const std::size_t size = std::min(kMaxStored, raw.size() - offset);
    const bool last = offset + size == raw.size();
    const auto len = static_cast<std::uint16_t>(size), nlen = static_cast<std::uint16_t>(~len);
    zlib.insert(zlib.end(),
                {static_cast<std::uint8_t>(last ? 1 : 0), static_cast<std::uint8_t>(len),
                 static_cast<std::uint8_t>(len >> 8), static_cast<std::uint8_t>(nlen),
                 static_cast<std::uint8_t>(nlen >> 8)});
    zlib.insert(zlib.end(), raw.begin() + offset, raw.begin() + offset + size);
    offset += size;
  } while (offset < raw.size());
  put_u32(zlib, adler32(raw));

  std::vector<std::uint8_t> header;
  put_u32(header, w);
  put_u32(header, h);
  // 8-bit RGB, compression deflate, filter method adaptive, no interlace.
  header.insert(header.end(), {8, 2, 0, 0, 0});
  std::vector<std::uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  put_chunk(png, "IHDR", header);
  put_chunk(png, "IDAT", zlib);
  put_chunk(png, "IEND", {});
  return png;
}

void write_png(const std::filesystem::path& path, const Image& image) {
  const std::vector<std::uint8_t> bytes = encode_png(image);
  std::filesystem::path temporary = path;
  temporary += ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(bytes.data()),
              static_cast<std::streamsize>(bytes.size()));
    out.close();
    if (!out) {
      detail::fail_as(ErrorKind::io, "write_png", "cannot write '", temporary.string(), "'");
    }
  }
  publish_file(temporary, path);
}

Image render_plot(const std::vector<PlotPanel>& panels) {
  Image image(kPanelWidth * static_cast<int>(std::max<std::size_t>(panels.size(), 1)),
              kPanelHeight);
  for (std::size_t i = 0; i < panels.size(); ++i) render_panel(image, i, panels[i]);
  return image;
}

void write_plot_png(const std::filesystem::path& path, const std::vector<PlotPanel>& panels) {
  write_png(path, render_plot(panels));
}

std::vector<PlotPanel> metrics_panels(const std::filesystem::path& metrics_jsonl) {
  std::ifstream in(metrics_jsonl);
  if (!in) {
    detail::fail_as(ErrorKind::io, "metrics_panels", "cannot open '", metrics_jsonl.string(), "'");
  }
  PlotSeries train_loss{"train", {}, {}}, eval_loss{"held-out", {}, {}, true};
  PlotSeries accuracy{"held-out", {}, {}, true}, speed{"train", {}, {}};
  std::string text;
  for (int line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    LineParser parser(text, metrics_jsonl, line);
    const auto values = parser.parse();
    if (!values.contains("step")) parser.fail("no \"step\" in the object");
    const double step = values.find("step")->second;
    if (values.contains("eval_loss")) {
      eval_loss.x.push_back(step);
      eval_loss.y.push_back(value_or_nan(values, "eval_loss"));
      accuracy.x.push_back(step);
      accuracy.y.push_back(value_or_nan(values, "eval_accuracy"));
    } else {
      train_loss.x.push_back(step);
      train_loss.y.push_back(value_or_nan(values, "loss"));
      speed.x.push_back(step);
      speed.y.push_back(value_or_nan(values, "tokens_per_s"));
    }
  }
  if (in.bad()) {
    detail::fail_as(ErrorKind::io, "metrics_panels", "cannot read '", metrics_jsonl.string(), "'");
  }
  // One step axis for all three panels, so that they line up by eye.
  const std::optional<Range> steps = padded_range({train_loss, eval_loss}, true);
  std::vector<PlotPanel> panels{
      {"loss", "step", "loss (nats/token)", {train_loss, eval_loss}, steps, std::nullopt},
      {"retrieval", "step", "held-out retrieval accuracy", {accuracy}, steps, Range{0.0, 1.0}},
      {"throughput", "step", "tokens/s", {speed}, steps, std::nullopt}};
  return panels;
}

void write_metrics_png(const std::filesystem::path& metrics_jsonl,
                       const std::filesystem::path& png) {
  write_plot_png(png, metrics_panels(metrics_jsonl));
}

}  // namespace ringattn::train
