#pragma once
/// @file
/// @brief trainloop::distributed::TerminateHook: a word before std::terminate ends the process
/// for an exception that escaped a thread. A backend that finds a mismatch in its own thread
/// (Gloo: "Received data size doesn't match") ends the process that way; the stall watchdog
/// hooks in here to name the desync first.

#include <atomic>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>

namespace trainloop::distributed {

/// While it lives, an exception that ends the process through std::terminate on any thread but
/// one is first handed, by its message, to a handler; then the terminate handler that was there
/// before runs (or std::abort). One at a time per process: the stall watchdog's.
class TerminateHook {
 public:
  /// What the handler is given: the exception's what(), or words saying it is not a
  /// std::exception.
  using Handler = std::function<void(const std::string& error)>;

  /// Installs the hook.
  /// @param handler called with the escaping exception's message
  /// @param ignored a thread whose exceptions are not handed to `handler` (the watchdog's own: it
  ///        may hold the locks the handler needs)
  TerminateHook(Handler handler, std::thread::id ignored) : handler_(std::move(handler)), ignored_(ignored) {
    instance() = this;
    previous() = std::set_terminate(&TerminateHook::on_terminate);
  }
  TerminateHook(const TerminateHook&) = delete;
  TerminateHook& operator=(const TerminateHook&) = delete;
  /// Puts back the terminate handler that was there before.
  ~TerminateHook() {
    std::set_terminate(previous());
    instance() = nullptr;
  }

 private:
  static std::atomic<TerminateHook*>& instance() {
    static std::atomic<TerminateHook*> hook{nullptr};
    return hook;
  }
  static std::terminate_handler& previous() {
    static std::terminate_handler handler = nullptr;
    return handler;
  }
  /// An exception escaped a thread (or main): the handler first, then the one that was there
  /// before.
  static void on_terminate() {
    TerminateHook* self = instance().load();
    if (self != nullptr && std::current_exception() && std::this_thread::get_id() != self->ignored_) {
      std::string error = "an exception that is not a std::exception";
      try {
        std::rethrow_exception(std::current_exception());
      } catch (const std::exception& escaped) {
        error = escaped.what();
      } catch (...) {
      }
      self->handler_(error);
    }
    if (std::terminate_handler handler = previous()) handler();
    std::abort();
  }

  Handler handler_;
  std::thread::id ignored_;
};

}  // namespace trainloop::distributed
