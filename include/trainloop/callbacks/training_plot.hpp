#pragma once
/// @file
/// @brief TrainingPlot: training curves as pictures — one panel for the loss and one per metric,
/// train and validation per epoch — written as PNG and SVG at the end of fit() (and optionally
/// after every epoch), from the main process only.
///
/// @code
/// loop.fit(10, {std::make_shared<trainloop::TrainingPlot>("runs/fmnist/curves.png")});
/// // runs/fmnist/curves.png and runs/fmnist/curves.svg
/// @endcode
///
/// Drawing uses cairo (Debian libcairo2-dev: anti-aliased lines and text, PNG and SVG output)
/// when the CMake package found it (TRAINLOOP_WITH_CAIRO); without it only the SVG is written, by a
/// small writer of its own, from the same drawing code. Both are written atomically.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>

#ifdef TRAINLOOP_WITH_CAIRO
#include <cairo-svg.h>
#include <cairo.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

namespace detail {

/// The few drawing operations a plot needs (coordinates in pixels, origin top left).
class Canvas {
 public:
  virtual ~Canvas() = default;
  /// A polyline in `rgb` (0..1 each), `width` pixels wide.
  virtual void polyline(const std::vector<std::pair<double, double>>& points, const std::array<double, 3>& rgb, double width) = 0;
  /// A filled circle.
  virtual void dot(double x, double y, double radius, const std::array<double, 3>& rgb) = 0;
  /// Text with its anchor at (x, y): `align` 0 left, 0.5 centre, 1 right; baseline at y.
  virtual void text(double x, double y, const std::string& text, double size, double align, bool bold = false) = 0;
};

/// SVG text of its own, when cairo is not there.
class SvgCanvas : public Canvas {
 public:
  SvgCanvas(double width, double height) {
    out_ << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
         << "\" viewBox=\"0 0 " << width << ' ' << height << "\" font-family=\"sans-serif\">\n"
         << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  }
  void polyline(const std::vector<std::pair<double, double>>& points, const std::array<double, 3>& rgb, double width) override {
    out_ << "<polyline fill=\"none\" stroke=\"" << color(rgb) << "\" stroke-width=\"" << width << "\" points=\"";
    for (const auto& [x, y] : points) out_ << x << ',' << y << ' ';
    out_ << "\"/>\n";
  }
  void dot(double x, double y, double radius, const std::array<double, 3>& rgb) override {
    out_ << "<circle cx=\"" << x << "\" cy=\"" << y << "\" r=\"" << radius << "\" fill=\"" << color(rgb) << "\"/>\n";
  }
  void text(double x, double y, const std::string& text, double size, double align, bool bold) override {
    const char* anchor = align < 0.25 ? "start" : align > 0.75 ? "end" : "middle";
    out_ << "<text x=\"" << x << "\" y=\"" << y << "\" font-size=\"" << size << "\" text-anchor=\"" << anchor << '"'
         << (bold ? " font-weight=\"bold\"" : "") << '>' << escape(text) << "</text>\n";
  }
  /// The document.
  std::string finish() {
    out_ << "</svg>\n";
    return out_.str();
  }

 private:
  static std::string color(const std::array<double, 3>& rgb) {
    char text[8];
    std::snprintf(text, sizeof text, "#%02x%02x%02x", static_cast<int>(rgb[0] * 255), static_cast<int>(rgb[1] * 255),
                  static_cast<int>(rgb[2] * 255));
    return text;
  }
  static std::string escape(const std::string& text) {
    std::string out;
    for (char c : text) out += c == '<' ? "&lt;" : c == '>' ? "&gt;" : c == '&' ? "&amp;" : std::string(1, c);
    return out;
  }
  std::ostringstream out_;
};

#ifdef TRAINLOOP_WITH_CAIRO
/// Drawing on a cairo surface (PNG image or SVG).
class CairoCanvas : public Canvas {
 public:
  explicit CairoCanvas(cairo_t* cairo) : cairo_(cairo) {
    cairo_set_source_rgb(cairo_, 1, 1, 1);
    cairo_paint(cairo_);
    cairo_set_line_join(cairo_, CAIRO_LINE_JOIN_ROUND);
  }
  void polyline(const std::vector<std::pair<double, double>>& points, const std::array<double, 3>& rgb, double width) override {
    if (points.empty()) return;
    cairo_set_source_rgb(cairo_, rgb[0], rgb[1], rgb[2]);
    cairo_set_line_width(cairo_, width);
    cairo_move_to(cairo_, points[0].first, points[0].second);
    for (size_t i = 1; i < points.size(); ++i) cairo_line_to(cairo_, points[i].first, points[i].second);
    cairo_stroke(cairo_);
  }
  void dot(double x, double y, double radius, const std::array<double, 3>& rgb) override {
    cairo_set_source_rgb(cairo_, rgb[0], rgb[1], rgb[2]);
    cairo_arc(cairo_, x, y, radius, 0, 2 * M_PI);
    cairo_fill(cairo_);
  }
  void text(double x, double y, const std::string& text, double size, double align, bool bold) override {
    cairo_set_source_rgb(cairo_, 0.1, 0.1, 0.1);
    cairo_select_font_face(cairo_, "sans-serif", CAIRO_FONT_SLANT_NORMAL, bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cairo_, size);
    cairo_text_extents_t extents;
    cairo_text_extents(cairo_, text.c_str(), &extents);
    cairo_move_to(cairo_, x - align * extents.x_advance, y);
    cairo_show_text(cairo_, text.c_str());
  }

 private:
  cairo_t* cairo_;
};
#endif

/// One panel: a series per name ("train", "val"), values per epoch (missing epochs: NaN).
struct PlotPanel {
  std::string title;
  std::vector<int64_t> epochs;
  std::map<std::string, std::vector<double>> series;
};

/// "Nice" tick values covering [low, high]: steps of 1, 2 or 5 times a power of ten.
inline std::vector<double> nice_ticks(double low, double high, int wanted = 5) {
  if (!(high > low)) {
    const double pad = std::max(std::abs(low) * 0.05, 1e-3);
    low -= pad;
    high += pad;
  }
  const double raw = (high - low) / wanted;
  const double power = std::pow(10.0, std::floor(std::log10(raw)));
  const double step = raw / power < 1.5 ? power : raw / power < 3.5 ? 2 * power : raw / power < 7.5 ? 5 * power : 10 * power;
  std::vector<double> ticks;
  for (double t = std::floor(low / step) * step; t <= high + step * 0.5; t += step) ticks.push_back(t);
  return ticks;
}

/// Draws the panels side by side, `panel_width` x `height` each.
inline void draw_panels(Canvas& canvas, const std::vector<PlotPanel>& panels, double panel_width, double height) {
  const std::array<double, 3> axis{0.25, 0.25, 0.25}, grid{0.88, 0.88, 0.88};
  const std::map<std::string, std::array<double, 3>> colors{{"train", {0.12, 0.47, 0.71}}, {"validation", {1.0, 0.5, 0.05}}};
  for (size_t p = 0; p < panels.size(); ++p) {
    const PlotPanel& panel = panels[p];
    const double left = p * panel_width + 62, right = (p + 1) * panel_width - 16, top = 40, bottom = height - 48;
    double low = std::numeric_limits<double>::infinity(), high = -low;
    for (const auto& [name, values] : panel.series) {
      for (double v : values) {
        if (std::isfinite(v)) low = std::min(low, v), high = std::max(high, v);
      }
    }
    if (!std::isfinite(low)) continue;
    const auto ticks = nice_ticks(low, high);
    const double y_low = ticks.front(), y_high = ticks.back();
    const double x_low = static_cast<double>(panel.epochs.front()), x_high = static_cast<double>(panel.epochs.back());
    auto x_of = [&](double epoch) { return x_high > x_low ? left + (epoch - x_low) / (x_high - x_low) * (right - left) : (left + right) / 2; };
    auto y_of = [&](double value) { return bottom - (value - y_low) / (y_high - y_low) * (bottom - top); };
    for (double t : ticks) {
      canvas.polyline({{left, y_of(t)}, {right, y_of(t)}}, grid, 1);
      std::ostringstream label;
      label << std::setprecision(3) << t;
      canvas.text(left - 6, y_of(t) + 4, label.str(), 11, 1);
    }
    const int64_t epoch_step = std::max<int64_t>(1, static_cast<int64_t>(panel.epochs.size() + 7) / 8);
    for (size_t i = 0; i < panel.epochs.size(); i += static_cast<size_t>(epoch_step)) {
      const double x = x_of(static_cast<double>(panel.epochs[i]));
      canvas.polyline({{x, bottom}, {x, bottom + 4}}, axis, 1);
      canvas.text(x, bottom + 17, std::to_string(panel.epochs[i]), 11, 0.5);
    }
    canvas.polyline({{left, top}, {left, bottom}, {right, bottom}}, axis, 1.2);
    canvas.text((left + right) / 2, height - 12, "epoch", 12, 0.5);
    canvas.text((left + right) / 2, 24, panel.title, 15, 0.5, true);
    // Every curve, in pixels; the legend goes into the corner its points cross least.
    std::vector<std::vector<std::pair<double, double>>> curves;
    for (const auto& [name, values] : panel.series) {
      std::vector<std::pair<double, double>> points;
      for (size_t i = 0; i < values.size(); ++i) {
        if (std::isfinite(values[i])) points.emplace_back(x_of(static_cast<double>(panel.epochs[i])), y_of(values[i]));
      }
      curves.push_back(std::move(points));
    }
    const double legend_width = 100, legend_height = 17.0 * static_cast<double>(panel.series.size()) + 6;
    const std::array<std::pair<double, double>, 4> corners{{{right - legend_width, top + 2},
                                                            {right - legend_width, bottom - legend_height - 4},
                                                            {left + 12, top + 2},
                                                            {left + 12, bottom - legend_height - 4}}};
    auto crossings = [&](const std::pair<double, double>& corner) {
      int count = 0;
      for (const auto& points : curves) {
        for (size_t i = 0; i + 1 < points.size(); ++i) {
          for (int k = 0; k <= 40; ++k) {  // samples along each segment
            const double x = points[i].first + (points[i + 1].first - points[i].first) * k / 40.0;
            const double y = points[i].second + (points[i + 1].second - points[i].second) * k / 40.0;
            count += x >= corner.first && x <= corner.first + legend_width && y >= corner.second &&
                     y <= corner.second + legend_height;
          }
        }
      }
      return count;
    };
    auto corner = corners[0];
    for (const auto& candidate : corners) {
      if (crossings(candidate) < crossings(corner)) corner = candidate;
    }
    double legend_y = corner.second + 12;
    size_t series_index = 0;
    for (const auto& [name, values] : panel.series) {
      const auto color = colors.count(name) ? colors.at(name) : std::array<double, 3>{0.3, 0.3, 0.3};
      const auto& points = curves[series_index++];
      canvas.polyline(points, color, 2.2);
      for (const auto& [x, y] : points) canvas.dot(x, y, 3.2, color);
      canvas.polyline({{corner.first + 8, legend_y - 4}, {corner.first + 28, legend_y - 4}}, color, 2.2);
      canvas.text(corner.first + 34, legend_y, name, 12, 0);
      legend_y += 17;
    }
  }
}

/// The panels of a History: loss, then each metric; train and validation series.
inline std::vector<PlotPanel> history_panels(const History& history) {
  std::vector<PlotPanel> panels;
  PlotPanel loss{"loss", {}, {}};
  std::map<std::string, PlotPanel> metrics;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const auto& record : history.epochs) {
    loss.epochs.push_back(record.epoch);
    loss.series["train"].push_back(record.train_loss);
    loss.series["validation"].push_back(record.validation ? record.validation->loss : nan);
    for (const auto& [name, value] : record.train_metrics) metrics[name].title = name;
    if (record.validation) {
      for (const auto& [name, value] : record.validation->metrics) metrics[name].title = name;
    }
  }
  for (auto& [name, panel] : metrics) {
    for (const auto& record : history.epochs) {
      panel.epochs.push_back(record.epoch);
      auto train = record.train_metrics.find(name);
      panel.series["train"].push_back(train != record.train_metrics.end() ? train->second : nan);
      std::optional<double> validation;
      if (record.validation) {
        auto found = record.validation->metrics.find(name);
        if (found != record.validation->metrics.end()) validation = found->second;
      }
      panel.series["validation"].push_back(validation.value_or(nan));
    }
  }
  bool any_validation = false;
  for (double v : loss.series["validation"]) any_validation = any_validation || std::isfinite(v);
  if (!any_validation) loss.series.erase("validation");
  panels.push_back(std::move(loss));
  for (auto& [name, panel] : metrics) panels.push_back(std::move(panel));
  return panels;
}

}  // namespace detail

/// @brief Writes the training curves of the loop's History as `path` (PNG, with cairo) and the
/// same name with `.svg` (see the file comment).
class TrainingPlot : public Callback {
 public:
  /// @param path the PNG to write, e.g. "runs/curves.png" (its directory must exist)
  /// @param every_epoch redraw after every epoch too (otherwise once, when fit() ends)
  explicit TrainingPlot(std::filesystem::path path, bool every_epoch = false)
      : path_(std::move(path)), every_epoch_(every_epoch) {}
  /// Writes files: the main process only.
  bool main_process_only() const override { return true; }
  /// @brief The PNG written (only when cairo was compiled in).
  const std::filesystem::path& png_path() const { return path_; }
  /// @brief The SVG written.
  std::filesystem::path svg_path() const { return std::filesystem::path(path_).replace_extension(".svg"); }
  /// @brief True when the PNG is drawn (cairo was found at configure time).
  static constexpr bool draws_png() {
#ifdef TRAINLOOP_WITH_CAIRO
    return true;
#else
    return false;
#endif
  }

  void on_fit_begin(TrainState&) override {
    // A path in a missing or read-only directory fails before training, not after it.
    { detail::AtomicFile probe(svg_path(), "the training plot"); }
  }
  void on_epoch_end(TrainState& state, const EpochRecord&) override {
    if (every_epoch_) draw(*state.history);
  }
  void on_fit_end(TrainState&, const History& history) override { draw(history); }

  /// @brief Draws `history` now.
  void draw(const History& history) const {
    if (history.epochs.empty()) return;
    const auto panels = detail::history_panels(history);
    const double panel_width = 380, height = 300, width = panel_width * static_cast<double>(panels.size());
#ifdef TRAINLOOP_WITH_CAIRO
    {
      detail::AtomicFile png(path_, "the training plot");
      cairo_surface_t* surface = cairo_image_surface_create(CAIRO_FORMAT_RGB24, static_cast<int>(width), static_cast<int>(height));
      cairo_t* cairo = cairo_create(surface);
      detail::CairoCanvas canvas(cairo);
      detail::draw_panels(canvas, panels, panel_width, height);
      cairo_destroy(cairo);
      const cairo_status_t status = cairo_surface_write_to_png(surface, png.temporary().c_str());
      cairo_surface_destroy(surface);
      TRAINLOOP_CHECK(status == CAIRO_STATUS_SUCCESS, "cannot write the training plot ", path_.string(), ": ",
                      cairo_status_to_string(status));
      png.commit();
    }
    {
      detail::AtomicFile svg(svg_path(), "the training plot");
      cairo_surface_t* surface = cairo_svg_surface_create(svg.temporary().c_str(), width, height);
      cairo_t* cairo = cairo_create(surface);
      detail::CairoCanvas canvas(cairo);
      detail::draw_panels(canvas, panels, panel_width, height);
      cairo_destroy(cairo);
      cairo_surface_finish(surface);
      cairo_surface_destroy(surface);
      svg.commit();
    }
#else
    detail::SvgCanvas canvas(width, height);
    detail::draw_panels(canvas, panels, panel_width, height);
    detail::write_file_atomically(svg_path(), canvas.finish(), "the training plot");
#endif
  }

 private:
  std::filesystem::path path_;
  bool every_epoch_;
};

}  // namespace trainloop
