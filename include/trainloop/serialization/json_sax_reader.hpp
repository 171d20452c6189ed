#pragma once
/// @file
/// @brief A base for readers of strangers' JSON that walk a document's outer levels themselves, as
/// the parser reads it (nlohmann's SAX interface), and hold at most one inner value at a time as a
/// JSON value (a safetensors tensor's object, a bad value to quote in a message).
///
/// Why not a DOM: nlohmann's DOM takes 25-33 bytes of memory per byte of JSON at worst (a 94 MB
/// safetensors header peaked at 2.66 GB; issue 50), while the formats' own structures need a few.
/// The caller bounds the nesting first (json_depth_beyond in nesting_depth.hpp, linear time), so a
/// captured value is small and nothing here recurses deeply.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// @brief Walks the levels a reader knows (enter_object), hands it every other value whole
/// (on_value), or skips it without holding it (skip_value). Throwing from a hook ends the parse
/// with that exception.
class JsonSaxReader : public nlohmann::json_sax<nlohmann::json> {
 public:
  /// What the JSON parser said, when the text is not JSON (sax_parse returned false).
  const std::string& parse_failure() const { return parse_failure_; }

  /// @cond INTERNAL
  bool null() override { return scalar(nullptr); }
  bool boolean(bool value) override { return scalar(value); }
  bool number_integer(number_integer_t value) override { return scalar(value); }
  bool number_unsigned(number_unsigned_t value) override { return scalar(value); }
  bool number_float(number_float_t value, const string_t& /*text*/) override { return scalar(value); }
  bool string(string_t& value) override {
    if (skipping_ > 0) return true;
    if (open_.empty()) {
      on_string(value);
      return true;
    }
    return scalar(std::move(value));
  }
  bool binary(binary_t& value) override { return scalar(nlohmann::json::binary(std::move(value))); }
  bool start_object(std::size_t /*elements*/) override {
    if (skipping_ == 0 && open_.empty() && enter_object()) return true;
    return open(nlohmann::json::object());
  }
  bool start_array(std::size_t /*elements*/) override { return open(nlohmann::json::array()); }
  bool key(string_t& key) override {
    if (skipping_ > 0) return true;
    if (open_.empty()) {
      on_key(std::move(key));
    } else {
      pending_key_ = std::move(key);
    }
    return true;
  }
  bool end_object() override { return close(true); }
  bool end_array() override { return close(false); }
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const nlohmann::detail::exception& error) override {
    parse_failure_ = error.what();
    return false;
  }
  /// @endcond

 protected:
  /// An object starts outside any held value: true when the reader walks into it itself (the
  /// root, a section it reads key by key); false to have it whole in on_value (or skipped).
  virtual bool enter_object() = 0;
  /// An object the reader walked into ends.
  virtual void leave_object() = 0;
  /// A key of an object the reader walks.
  virtual void on_key(std::string key) = 0;
  /// A whole value (scalar, or an array or object held as JSON) at a place the reader walks.
  virtual void on_value(const nlohmann::json& value) = 0;
  /// A string at a place the reader walks (the common value, kept out of any JSON value).
  virtual void on_string(std::string& value) { on_value(nlohmann::json(std::move(value))); }
  /// True when the next array or object at a walked place is not wanted: it is read and dropped
  /// without holding it (on_value is not called for it).
  virtual bool skip_value() const { return false; }

 private:
  bool scalar(nlohmann::json value) {
    if (skipping_ > 0) return true;
    if (open_.empty()) {
      on_value(value);
    } else {
      add(std::move(value));
    }
    return true;
  }
  bool open(nlohmann::json container) {
    if (skipping_ > 0 || (open_.empty() && skip_value())) {
      ++skipping_;
    } else if (open_.empty()) {
      held_ = std::move(container);
      open_.push_back(&held_);
    } else {
      open_.push_back(add(std::move(container)));
    }
    return true;
  }
  bool close(bool object) {
    if (skipping_ > 0) {
      --skipping_;
    } else if (!open_.empty()) {
      open_.pop_back();
      if (open_.empty()) on_value(held_);
    } else if (object) {
      leave_object();
    }
    return true;
  }
  /// Adds `value` to the innermost open container; returns where it is (stable while it is the
  /// innermost: its parent grows only after it closes).
  nlohmann::json* add(nlohmann::json value) {
    nlohmann::json& parent = *open_.back();
    if (parent.is_array()) {
      parent.push_back(std::move(value));
      return &parent.back();
    }
    nlohmann::json& slot = parent[pending_key_];
    slot = std::move(value);
    return &slot;
  }

  nlohmann::json held_;                // the value being held (outermost container)
  std::vector<nlohmann::json*> open_;  // its containers still open, outermost first
  std::string pending_key_;            // the key of the next value in the innermost open object
  size_t skipping_ = 0;                // depth inside a value being skipped
  std::string parse_failure_;
};

}  // namespace trainloop::serialization
