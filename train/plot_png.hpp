// A run's curves as a PNG, with nothing beyond the C++ standard library: an RGB image, a PNG
// encoder (zlib stream of stored deflate blocks: larger files, no compressor to carry), and a
// line-chart renderer with an embedded 5x7 bitmap font.
//
//   write_metrics_png(run_dir / "metrics.jsonl", run_dir / "metrics.png");
//
// draws what tools/plot_metrics draws, side by side: loss (train and held-out) against the step,
// held-out retrieval accuracy (0..1) and tokens/s.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ringattn::train {

struct Rgb {
  std::uint8_t r = 0, g = 0, b = 0;
  friend bool operator==(const Rgb&, const Rgb&) = default;
};

inline constexpr Rgb kBackground{255, 255, 255};
inline constexpr Rgb kGridColour{225, 225, 225};
inline constexpr Rgb kInkColour{40, 40, 40};  // axes, ticks, text
// Series i of a panel takes colour i % size (matplotlib's first tab10 colours).
inline constexpr std::array<Rgb, 5> kSeriesColours{
    {{31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40}, {148, 103, 189}}};

// Row-major pixels, (0, 0) at the top left. Writes outside the image are dropped.
class Image {
 public:
  Image(int width, int height, Rgb fill = kBackground);
  int width() const { return width_; }
  int height() const { return height_; }
  Rgb at(int x, int y) const { return pixels_[static_cast<std::size_t>(y) * width_ + x]; }
  void set(int x, int y, Rgb colour) {
    if (x >= 0 && y >= 0 && x < width_ && y < height_) {
      pixels_[static_cast<std::size_t>(y) * width_ + x] = colour;
    }
  }

 private:
  int width_, height_;
  std::vector<Rgb> pixels_;
};

// The PNG file's bytes: 8-bit RGB, no interlace, filter 0 on every row.
std::vector<std::uint8_t> encode_png(const Image& image);

// Writes `path` + ".tmp" and renames it over `path` (train/atomic_file.hpp), so a reader never
// sees half a file. Throws ringattn::Error (ErrorKind::io) naming the file.
void write_png(const std::filesystem::path& path, const Image& image);

struct PlotSeries {
  std::string name;          // legend entry; a series with an empty name stays out of the legend
  std::vector<double> x, y;  // same length; a point with a non-finite x or y is a gap in the line
  bool markers = false;      // a dot at every point, for sparse series (evaluations)
};

// Without a range, an axis spans the finite data padded by 5% of its span on each side (a span of
// 0 widens to +-5% of the value, or +-1 at 0); a panel without finite data spans 0..1 and says
// "no data".
struct PlotPanel {
  std::string title, x_label, y_label;
  std::vector<PlotSeries> series;
  std::optional<std::pair<double, double>> x_range, y_range;
};

// Layout: panel i occupies columns [i * kPanelWidth, (i + 1) * kPanelWidth) of a
// (panels * kPanelWidth) x kPanelHeight image. Its data lives in the plot area; the frame is
// drawn just outside it and lines are clipped to it. A point (x, y) of axis ranges
// [x0, x1] x [y0, y1] lands on pixel
//   column left + lround((x - x0) / (x1 - x0) * (width - 1)),
//   row    top + height - 1 - lround((y - y0) / (y1 - y0) * (height - 1));
// lines are 2 px wide (the point's pixel and its right, lower and lower-right neighbours),
// markers are discs of radius kMarkerRadius.
inline constexpr int kPanelWidth = 440, kPanelHeight = 330;
inline constexpr int kPlotLeft = 70, kPlotRight = 16, kPlotTop = 34, kPlotBottom = 46;
inline constexpr int kMarkerRadius = 3;

struct PlotArea {
  int left, top, width, height;
};

constexpr PlotArea plot_area(std::size_t panel) {
  return {static_cast<int>(panel) * kPanelWidth + kPlotLeft, kPlotTop,
          kPanelWidth - kPlotLeft - kPlotRight, kPanelHeight - kPlotTop - kPlotBottom};
}

Image render_plot(const std::vector<PlotPanel>& panels);

// render_plot, then write_png.
void write_plot_png(const std::filesystem::path& path, const std::vector<PlotPanel>& panels);

// The three panels of a metrics.jsonl (one flat JSON object a line, as Trainer::run writes it):
// lines with "eval_loss" are evaluations ("step", "eval_loss", optional "eval_accuracy"), the
// others training steps ("step", "loss", "tokens_per_s"). null and missing values are gaps. Throws
// ringattn::Error (ErrorKind::io) for an unreadable file, and for a line that is not a flat object
// of numbers, strings, booleans and nulls or has no "step", naming the file and the line number.
std::vector<PlotPanel> metrics_panels(const std::filesystem::path& metrics_jsonl);

// write_plot_png(png, metrics_panels(metrics_jsonl)).
void write_metrics_png(const std::filesystem::path& metrics_jsonl,
                       const std::filesystem::path& png);

}  // namespace ringattn::train
