#pragma once
/// @file
/// @brief The unpickler behind read_python_state_dict(): the part of Python's pickle format that
/// `torch.save(model.state_dict(), path)` writes into `data.pkl`, read into tensors.
///
/// Why not libtorch's own torch::jit::Unpickler (pickle_load)? It reads a plain dict saved by
/// Python, but not the `collections.OrderedDict` that `state_dict()` returns: its handling of
/// that global is hard-coded (before any type resolver is asked) to produce None, because it
/// expects an OrderedDict only as a tensor's empty `backward_hooks`; the SETITEMS that follows
/// then fails (`isGenericDict() INTERNAL ASSERT FAILED ... Expected GenericDict but got None`).
/// It also treats BUILD as REDUCE, so the `_metadata` attribute that the dict carries (set by
/// BUILD) could not be read either. Both are so in libtorch 1.13 and in 2.x (checked against
/// torch/csrc/jit/serialization/unpickler.cpp of both), so no option or callback of it helps.
///
/// What is read: pickle protocols 2 to 5 as Python writes containers, numbers and strings, and
/// the few globals and persistent ids a state_dict uses (interop/pickle_globals.hpp).

#include <trainloop/error.hpp>
#include <trainloop/interop/pickle_globals.hpp>
#include <trainloop/interop/pickle_value.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <ios>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainloop::interop::detail {

/// Loads storage `key` (`data/<key>` in the archive) of `numel` elements of `dtype`, as a 1-d tensor.
using StorageLoader = std::function<torch::Tensor(const std::string& key, torch::ScalarType dtype, int64_t numel)>;

/// Reads one pickle (the bytes of `data.pkl`) into its top-level value.
class StateDictUnpickler {
 public:
  /// @param bytes the pickle; must outlive the unpickler
  /// @param load_storage reads a storage the pickle refers to by persistent id
  StateDictUnpickler(std::string_view bytes, StorageLoader load_storage)
      : bytes_(bytes), load_storage_(std::move(load_storage)) {}

  /// Runs the pickle to its STOP.
  /// @throws PickleError naming the byte offset of the opcode that failed and the reason.
  PickleValue run() {
    try {
      if (bytes_.empty() || static_cast<uint8_t>(bytes_[0]) != 0x80) fail("it does not start with a pickle PROTO opcode");
      while (true) {
        opcode_at_ = pos_;
        const auto opcode = static_cast<uint8_t>(take(1)[0]);
        if (opcode == '.') break;  // STOP
        step(opcode);
      }
      if (stack_.size() != 1) fail("the pickle ends with ", stack_.size(), " values on its stack; expected 1");
    } catch (const PickleError& error) {
      throw PickleError(trainloop::detail::concat("at byte ", opcode_at_, ": ", error.what()));
    }
    return stack_.back();
  }

 private:
  template <class... Parts>
  [[noreturn]] static void fail(Parts&&... parts) {
    pickle_fail(std::forward<Parts>(parts)...);
  }

  std::string_view take(size_t count) {
    if (count > bytes_.size() - pos_) fail("the pickle is truncated");
    const auto piece = bytes_.substr(pos_, count);
    pos_ += count;
    return piece;
  }
  template <class T>
  T little_endian() {  // pickle's integer arguments are little-endian, as this machine
    T value;
    std::memcpy(&value, take(sizeof(T)).data(), sizeof(T));
    return value;
  }
  std::string line() {
    const auto end = bytes_.find('\n', pos_);
    if (end == std::string_view::npos) fail("the pickle is truncated");
    const size_t length = end - pos_;
    return std::string(take(length + 1).substr(0, length));
  }

  PickleValue pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back())) fail("the pickle's stack is empty");
    PickleValue value = std::move(stack_.back());
    stack_.pop_back();
    return value;
  }
  /// The values pushed since the last MARK, removed from the stack.
  std::vector<PickleValue> pop_to_mark() {
    if (marks_.empty()) fail("the pickle has no MARK to end");
    const size_t start = marks_.back();
    marks_.pop_back();
    std::vector<PickleValue> values(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(start)),
                                    std::make_move_iterator(stack_.end()));
    stack_.resize(start);
    return values;
  }
  PickleValue& top(PickleValue::Kind kind) {
    if (stack_.empty()) fail("the pickle's stack is empty");
    if (stack_.back().kind != kind) fail(a_kind(stack_.back().kind), " is where ", a_kind(kind), " is expected");
    return stack_.back();
  }
  void push_int(int64_t value) {
    PickleValue v = PickleValue::of(PickleValue::Kind::Int);
    v.integer = value;
    stack_.push_back(std::move(v));
  }
  void push_text(PickleValue::Kind kind, std::string text) {
    PickleValue v = PickleValue::of(kind);
    v.text = std::move(text);
    stack_.push_back(std::move(v));
  }
  void push_tuple(std::vector<PickleValue> elements) {
    PickleValue v = PickleValue::of(PickleValue::Kind::Tuple);
    *v.items = std::move(elements);
    stack_.push_back(std::move(v));
  }
  void memo_put(size_t id) {
    if (stack_.empty()) fail("the pickle memoizes from an empty stack");
    if (memo_.size() <= id) memo_.resize(id + 1);
    memo_[id] = stack_.back();
  }
  void memo_get(size_t id) {
    if (id >= memo_.size() || !memo_[id]) fail("memo entry ", id, " was never stored");
    stack_.push_back(*memo_[id]);
  }
  void push_tuple_of_last(size_t count) {
    if (stack_.size() < count) fail("the pickle's stack is empty");
    std::vector<PickleValue> elements(std::make_move_iterator(stack_.end() - static_cast<std::ptrdiff_t>(count)),
                                      std::make_move_iterator(stack_.end()));
    stack_.resize(stack_.size() - count);
    push_tuple(std::move(elements));
  }

  void step(uint8_t opcode) {
    using Kind = PickleValue::Kind;
    switch (opcode) {
      case 0x80: {  // PROTO
        const auto protocol = static_cast<uint8_t>(take(1)[0]);
        if (protocol < 2 || protocol > 5) fail("pickle protocol ", int(protocol), "; expected 2 (torch.save's) to 5");
        break;
      }
      case 0x95: take(8); break;  // FRAME: only a read-ahead hint
      case '(': marks_.push_back(stack_.size()); break;  // MARK
      case '0': pop(); break;                            // POP
      case '1': pop_to_mark(); break;                    // POP_MARK
      case '2': {  // DUP
        PickleValue copy = pop();
        stack_.push_back(copy);
        stack_.push_back(std::move(copy));
        break;
      }
      case 'N': stack_.push_back(PickleValue::of(Kind::None)); break;
      case 0x88: case 0x89: {  // NEWTRUE, NEWFALSE
        PickleValue v = PickleValue::of(Kind::Bool);
        v.integer = opcode == 0x88;
        stack_.push_back(std::move(v));
        break;
      }
      case 'K': push_int(little_endian<uint8_t>()); break;   // BININT1
      case 'M': push_int(little_endian<uint16_t>()); break;  // BININT2
      case 'J': push_int(little_endian<int32_t>()); break;   // BININT
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes
        const auto n = static_cast<uint8_t>(take(1)[0]);
        if (n > 8) fail("an integer of ", int(n), " bytes; expected at most 8");
        uint64_t value = 0;
        const auto digits = take(n);
        for (size_t i = 0; i < n; ++i) value |= uint64_t(static_cast<uint8_t>(digits[i])) << (8 * i);
        if (n > 0 && n < 8 && (static_cast<uint8_t>(digits[n - 1]) & 0x80)) value |= ~uint64_t(0) << (8 * n);
        push_int(static_cast<int64_t>(value));
        break;
      }
      case 'G': {  // BINFLOAT: big-endian
        uint64_t bits = 0;
        for (char byte : take(8)) bits = (bits << 8) | static_cast<uint8_t>(byte);
        PickleValue v = PickleValue::of(Kind::Float);
        std::memcpy(&v.real, &bits, sizeof bits);
        stack_.push_back(std::move(v));
        break;
      }
      case 0x8c: push_text(Kind::String, std::string(take(little_endian<uint8_t>()))); break;   // SHORT_BINUNICODE
      case 'X': push_text(Kind::String, std::string(take(little_endian<uint32_t>()))); break;   // BINUNICODE
      case 0x8d: push_text(Kind::String, std::string(take(little_endian<uint64_t>()))); break;  // BINUNICODE8
      case 'c': {  // GLOBAL: "module\nname\n"
        std::string module = line();
        push_text(Kind::Global, module + "." + line());
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        const PickleValue name = pop();
        const PickleValue module = pop();
        if (module.kind != Kind::String || name.kind != Kind::String) fail("STACK_GLOBAL of a non-string");
        push_text(Kind::Global, module.text + "." + name.text);
        break;
      }
      case 'q': memo_put(little_endian<uint8_t>()); break;   // BINPUT
      case 'r': memo_put(little_endian<uint32_t>()); break;  // LONG_BINPUT
      case 0x94: memo_put(memo_.size()); break;              // MEMOIZE
      case 'h': memo_get(little_endian<uint8_t>()); break;   // BINGET
      case 'j': memo_get(little_endian<uint32_t>()); break;  // LONG_BINGET
      case ')': stack_.push_back(PickleValue::of(Kind::Tuple)); break;  // EMPTY_TUPLE
      case ']': stack_.push_back(PickleValue::of(Kind::List)); break;   // EMPTY_LIST
      case '}': stack_.push_back(PickleValue::of(Kind::Dict)); break;   // EMPTY_DICT
      case 't': push_tuple(pop_to_mark()); break;                         // TUPLE
      case 0x85: case 0x86: case 0x87: push_tuple_of_last(opcode - 0x84u); break;  // TUPLE1-3
      case 'l': {  // LIST
        PickleValue v = PickleValue::of(Kind::List);
        *v.items = pop_to_mark();
        stack_.push_back(std::move(v));
        break;
      }
      case 'd': {  // DICT
        auto items = pop_to_mark();
        if (items.size() % 2 != 0) fail("a dict of an odd number of keys and values");
        stack_.push_back(PickleValue::of(Kind::Dict));
        *stack_.back().items = std::move(items);
        break;
      }
      case 'a': {  // APPEND
        PickleValue item = pop();
        top(Kind::List).items->push_back(std::move(item));
        break;
      }
      case 'e': {  // APPENDS
        auto items = pop_to_mark();
        auto& list = top(Kind::List).items;
        for (auto& item : items) list->push_back(std::move(item));
        break;
      }
      case 's': {  // SETITEM
        PickleValue value = pop();
        PickleValue key = pop();
        auto& dict = top(Kind::Dict).items;
        dict->push_back(std::move(key));
        dict->push_back(std::move(value));
        break;
      }
      case 'u': {  // SETITEMS
        auto items = pop_to_mark();
        if (items.size() % 2 != 0) fail("SETITEMS of an odd number of keys and values");
        auto& dict = top(Kind::Dict).items;
        for (auto& item : items) dict->push_back(std::move(item));
        break;
      }
      case 'Q': {  // BINPERSID
        stack_.push_back(persistent_load(pop()));
        break;
      }
      case 'R': {  // REDUCE
        PickleValue args = pop();
        PickleValue callable = pop();
        stack_.push_back(call_global(callable, args));
        break;
      }
      case 0x81: {  // NEWOBJ: cls.__new__(cls, *args), how Python pickles an instance of a class
        pop();
        const PickleValue cls = pop();
        fail("the pickle creates an object of ", cls.kind == Kind::Global ? cls.text : std::string(a_kind(cls.kind)),
             "; expected only tensors in a dict");
      }
      case 'b': {  // BUILD: sets an object's attributes
        pop();
        const Kind kind = stack_.empty() ? Kind::None : stack_.back().kind;
        // A state_dict's OrderedDict gets `_metadata` (each module's version, which Python's
        // load_state_dict hands to _load_from_state_dict); it says nothing about the values.
        if (kind != Kind::Dict && kind != Kind::Tensor) fail("BUILD on ", a_kind(kind), "; expected a dict or a tensor");
        break;
      }
      default:
        fail("opcode 0x", std::hex, int(opcode), std::dec,
             " is not one that torch.save writes for a state_dict; expected a pickle of a dict of tensors");
    }
  }

  /// A storage, loaded once per key, so that tensors viewing one storage share it as in Python.
  PickleValue persistent_load(const PickleValue& id) {
    const StorageId storage_id = parse_storage_id(id);
    auto& cached = storages_[storage_id.key];
    if (!cached.defined()) cached = load_storage_(storage_id.key, storage_id.dtype, storage_id.numel);
    PickleValue storage = PickleValue::of(PickleValue::Kind::Storage);
    storage.tensor = cached;
    return storage;
  }

  std::string_view bytes_;
  StorageLoader load_storage_;
  size_t pos_ = 0;
  size_t opcode_at_ = 0;  // where the opcode being run starts, for messages
  std::vector<PickleValue> stack_;
  std::vector<size_t> marks_;
  std::vector<std::optional<PickleValue>> memo_;
  std::map<std::string, torch::Tensor> storages_;
};

}  // namespace trainloop::interop::detail
