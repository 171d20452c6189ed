#pragma once
/// @file
/// @brief The unpickler behind every weights file trainloop reads: the safe subset of Python's
/// pickle format that `torch.save(model.state_dict(), path)` writes into `data.pkl` (and, for
/// TorchScript archives, the plain objects `torch.jit.save` / `torch::save` write), read into
/// tensors. Safe by construction, for files from strangers:
///
/// - no code: a global is checked against the allow-list (serialization/pickle/pickle_globals.hpp) the
///   moment the pickle names it, and what an allowed one does is done in C++
///   (serialization/pickle/pickle_objects.hpp); BUILD only on what the allow-list says takes state; no
///   opcode that needs another name (INST, OBJ, EXT*, PERSID) is read;
/// - no unbounded memory: values are handles into one PickleDocument (pickle_value.hpp), so DUP
///   and BINGET copy 24 bytes, never a string; the memo is a map, so an index of 2^32-1 costs one
///   entry; values (charged what they cost), stack, memo, nesting and open MARKs are counted
///   against PickleLimits;
/// - no recursion over values, so no nesting can exhaust the stack; nesting measured on the
///   finished pickle (PickleBuilder::check_nesting), cycles refused, before libtorch's own reader
///   (which recurses) is given any pickle of a TorchScript archive;
/// - MARK bookkeeping checked by every opcode: nothing takes a value from below the last MARK;
/// - tensors proved inside their storages with checked arithmetic (tensor_rebuild.hpp).
///
/// Why not libtorch's own torch::jit::Unpickler (pickle_load)? It reads a plain dict saved by
/// Python, but not the `collections.OrderedDict` that `state_dict()` returns: its handling of
/// that global is hard-coded (before any type resolver is asked) to produce None, because it
/// expects an OrderedDict only as a tensor's empty `backward_hooks`; the SETITEMS that follows
/// then fails (`isGenericDict() INTERNAL ASSERT FAILED ... Expected GenericDict but got None`).
/// It also treats BUILD as REDUCE, so the `_metadata` attribute that the dict carries (set by
/// BUILD) could not be read either, and it resolves TorchScript classes by compiling the
/// archive's code. Both are so in libtorch 1.13 and in 2.x (torch/csrc/jit/serialization/
/// unpickler.cpp of both), so no option or callback of it helps.

#include <trainloop/error.hpp>
#include <trainloop/serialization/pickle/pickle_cursor.hpp>
#include <trainloop/serialization/pickle/pickle_globals.hpp>
#include <trainloop/serialization/pickle/pickle_limits.hpp>
#include <trainloop/serialization/pickle/pickle_objects.hpp>
#include <trainloop/serialization/pickle/pickle_value.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ios>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// @brief Reads one pickle into a PickleDocument.
class Unpickler : private PickleObjects {
 public:
  /// @param bytes the pickle; must outlive run()
  /// @param flavor which globals it may name
  /// @param load_storage reads a storage the pickle refers to by persistent id
  /// @param limits the bounds it is held to
  Unpickler(std::string_view bytes, PickleFlavor flavor, StorageLoader load_storage, PickleLimits limits = {})
      : PickleObjects(limits, flavor, std::move(load_storage)), cursor_(bytes) {}

  /// @brief Runs the pickle to its STOP.
  /// @throws PickleError naming the byte offset of the opcode that failed and the reason.
  PickleDocument run() {
    try {
      const std::string_view bytes = cursor_.bytes();
      stats_.pickle_bytes = bytes.size();
      if (bytes.size() > limits_.max_pickle_bytes) {
        fail("the pickle has ", bytes.size(), " bytes; expected at most ", limits_.max_pickle_bytes);
      }
      set_budget_for(bytes.size());
      if (bytes.empty() || static_cast<uint8_t>(bytes[0]) != 0x80) fail("it does not start with a pickle PROTO opcode");
      while (true) {
        opcode_at_ = cursor_.position();
        const auto opcode = cursor_.byte();
        if (opcode == '.') break;  // STOP
        step(opcode);
        charge_stack(stack_.size());
        if (stack_.size() > limits_.max_stack) fail("the pickle holds more than ", limits_.max_stack, " values at once");
      }
      if (!marks_.empty()) fail("the pickle ends with ", marks_.size(), " MARKs open; expected none");
      if (stack_.size() != 1) fail("the pickle ends with ", stack_.size(), " values on its stack; expected 1");
      check_nesting();
    } catch (const PickleError& error) {
      throw PickleError(trainloop::detail::concat("at byte ", opcode_at_, ": ", error.what()));
    }
    stats_.memo = memo_.size();
    document_.root = stack_.back();
    return std::move(document_);
  }

  using PickleBuilder::stats;
  using PickleObjects::require_storage_location;

 private:
  // ---- stack and MARKs: nothing below the last MARK is reachable ----
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  PickleValue pop() {
    if (stack_.size() <= floor()) fail(marks_.empty() ? "the pickle's stack is empty" : "the pickle takes a value from below its MARK");
    PickleValue value = stack_.back();
    stack_.pop_back();
    return value;
  }
  const PickleValue& top() const {
    if (stack_.size() <= floor()) fail(marks_.empty() ? "the pickle's stack is empty" : "the pickle takes a value from below its MARK");
    return stack_.back();
  }
  const PickleValue& top(Kind kind) const {
    const auto& value = top();
    if (value.kind != kind) fail(a_kind(value.kind), " is where ", a_kind(kind), " is expected");
    return value;
  }
  /// The values pushed since the last MARK, removed from the stack with the MARK.
  std::vector<PickleValue> pop_to_mark() {
    if (marks_.empty()) fail("the pickle has no MARK to end");
    const size_t start = marks_.back();
    if (start > stack_.size()) fail("the pickle's MARK is above its stack");
    marks_.pop_back();
    std::vector<PickleValue> values(stack_.begin() + static_cast<std::ptrdiff_t>(start), stack_.end());
    stack_.resize(start);
    return values;
  }
  std::vector<PickleValue> pop_last(size_t count) {
    if (stack_.size() - floor() < count) fail("the pickle takes ", count, " values from a stack of ", stack_.size() - floor());
    std::vector<PickleValue> values(stack_.end() - static_cast<std::ptrdiff_t>(count), stack_.end());
    stack_.resize(stack_.size() - count);
    return values;
  }
  void push(PickleValue value) { stack_.push_back(value); }
  void push_int(Kind kind, int64_t integer) {
    PickleValue value;
    value.kind = kind;
    value.integer = integer;
    push(value);
  }

  // ---- memo ----
  void memo_put(uint64_t id) {
    const auto& value = top();
    auto [entry, added] = memo_.try_emplace(id, value);
    if (!added) {
      entry->second = value;
      return;
    }
    charge(kMemoEntryCost);
    if (memo_.size() > limits_.max_memo) fail("the pickle memoizes more than ", limits_.max_memo, " values");
  }
  void memo_get(uint64_t id) {
    const auto found = memo_.find(id);
    if (found == memo_.end()) fail("memo entry ", id, " was never stored");
    push(found->second);
  }

  void step(uint8_t opcode) {
    switch (opcode) {
      case 0x80: {  // PROTO
        const auto protocol = cursor_.byte();
        if (protocol < 2 || protocol > 5) fail("pickle protocol ", int(protocol), "; expected 2 (torch.save's) to 5");
        break;
      }
      case 0x95: cursor_.take(8); break;  // FRAME: only a read-ahead hint
      case '(':                   // MARK
        marks_.push_back(stack_.size());
        stats_.open_marks = std::max(stats_.open_marks, marks_.size());
        if (marks_.size() > limits_.max_open_marks) fail("the pickle opens more than ", limits_.max_open_marks, " MARKs");
        break;
      case '0': pop(); break;          // POP
      case '1': pop_to_mark(); break;  // POP_MARK
      case '2': push(top()); break;    // DUP
      case 'N': push(PickleValue{}); break;
      case 0x88: case 0x89: push_int(Kind::Bool, opcode == 0x88); break;  // NEWTRUE, NEWFALSE
      case 'K': push_int(Kind::Int, cursor_.little_endian<uint8_t>()); break;    // BININT1
      case 'M': push_int(Kind::Int, cursor_.little_endian<uint16_t>()); break;   // BININT2
      case 'J': push_int(Kind::Int, cursor_.little_endian<int32_t>()); break;    // BININT
      case 0x8a: {  // LONG1: little-endian two's complement of n bytes
        const auto n = cursor_.byte();
        if (n > 8) fail("an integer of ", int(n), " bytes; expected at most 8");
        uint64_t value = 0;
        const auto digits = cursor_.take(n);
        for (size_t i = 0; i < n; ++i) value |= uint64_t(static_cast<uint8_t>(digits[i])) << (8 * i);
        if (n > 0 && n < 8 && (static_cast<uint8_t>(digits[n - 1]) & 0x80)) value |= ~uint64_t(0) << (8 * n);
        push_int(Kind::Int, static_cast<int64_t>(value));
        break;
      }
      case 'G': {  // BINFLOAT: big-endian
        uint64_t bits = 0;
        for (char byte : cursor_.take(8)) bits = (bits << 8) | static_cast<uint8_t>(byte);
        PickleValue value;
        value.kind = Kind::Float;
        std::memcpy(&value.real, &bits, sizeof bits);
        push(value);
        break;
      }
      case 0x8c: push(make_text(Kind::String, cursor_.take(cursor_.little_endian<uint8_t>()))); break;   // SHORT_BINUNICODE
      case 'X': push(make_text(Kind::String, cursor_.take(cursor_.little_endian<uint32_t>()))); break;   // BINUNICODE
      case 0x8d: push(make_text(Kind::String, cursor_.take(cursor_.little_endian<uint64_t>()))); break;  // BINUNICODE8
      case 'c': {  // GLOBAL: "module\nname\n"
        const auto module = cursor_.line();
        push(global(module, cursor_.line()));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        const PickleValue name = pop();
        const PickleValue module = pop();
        if (module.kind != Kind::String || name.kind != Kind::String) fail("STACK_GLOBAL of a non-string");
        push(global(document_.text(module), document_.text(name)));
        break;
      }
      case 'q': memo_put(cursor_.little_endian<uint8_t>()); break;   // BINPUT
      case 'r': memo_put(cursor_.little_endian<uint32_t>()); break;  // LONG_BINPUT
      case 0x94: memo_put(memo_.size()); break;              // MEMOIZE
      case 'h': memo_get(cursor_.little_endian<uint8_t>()); break;   // BINGET
      case 'j': memo_get(cursor_.little_endian<uint32_t>()); break;  // LONG_BINGET
      case ')': push(make_container(Kind::Tuple, {})); break;  // EMPTY_TUPLE
      case ']': push(make_container(Kind::List, {})); break;   // EMPTY_LIST
      case '}': push(make_container(Kind::Dict, {})); break;   // EMPTY_DICT
      case 't': push(make_container(Kind::Tuple, pop_to_mark())); break;                  // TUPLE
      case 0x85: case 0x86: case 0x87: push(make_container(Kind::Tuple, pop_last(opcode - 0x84u))); break;  // TUPLE1-3
      case 'l': push(make_container(Kind::List, pop_to_mark())); break;                   // LIST
      case 'd': {  // DICT
        auto items = pop_to_mark();
        if (items.size() % 2 != 0) fail("a dict of an odd number of keys and values");
        push(make_container(Kind::Dict, std::move(items)));
        break;
      }
      case 'a': {  // APPEND
        auto item = pop_last(1);
        extend(top(Kind::List), std::move(item));
        break;
      }
      case 'e': {  // APPENDS
        auto items = pop_to_mark();
        extend(top(Kind::List), std::move(items));
        break;
      }
      case 's': {  // SETITEM
        auto pair = pop_last(2);
        extend(top(Kind::Dict), std::move(pair));
        break;
      }
      case 'u': {  // SETITEMS
        auto items = pop_to_mark();
        if (items.size() % 2 != 0) fail("SETITEMS of an odd number of keys and values");
        extend(top(Kind::Dict), std::move(items));
        break;
      }
      case 'Q': push(persistent_load(pop())); break;  // BINPERSID
      case 'R': {  // REDUCE
        const PickleValue args = pop();
        const PickleValue callable = pop();
        push(call(callable, args));
        break;
      }
      case 0x81: {  // NEWOBJ: cls.__new__(cls, *args), how a TorchScript object is pickled
        const PickleValue args = pop();
        const PickleValue cls = pop();
        push(new_object(cls, args));
        break;
      }
      case 'b': {  // BUILD: sets an object's attributes
        const PickleValue state = pop();
        build(top(), state);
        break;
      }
      default:
        fail("opcode 0x", std::hex, int(opcode), std::dec,
             " is not one that torch.save writes for weights; expected a pickle of a dict of tensors");
    }
  }

  PickleCursor cursor_;
  size_t opcode_at_ = 0;  // where the opcode being run starts, for messages
  std::vector<PickleValue> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PickleValue> memo_;
};

}  // namespace trainloop::serialization
