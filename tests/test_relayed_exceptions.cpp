#define BOOST_TEST_MODULE test_relayed_exceptions
#include "unit_test.hpp"

// The one table of exception classes that travel between spawned ranks and their caller
// (distributed/spawn/relayed_exceptions.hpp): each class arrives as itself, a rank's failure nests the
// RankFailedError with its details, and a replayed failure keeps them.

#include <trainloop/distributed/spawn/relayed_exceptions.hpp>

#include <string>

namespace tl = trainloop;
using namespace tl::distributed::detail;

namespace {

/// The class name the exception thrown by `f` travels as.
template <class F>
std::string travelled_name(F&& f) {
  try {
    f();
  } catch (const std::exception& error) {
    return relayed_type_name(error);
  }
  return "nothing thrown";
}

tl::RankFailedError rank_failure(const std::string& error_type) {
  tl::RankFailedError::Details details;
  details.rank = 1;
  details.exit_code = 1;
  details.rank_error = "checkpoint /ckpt/epoch3.ckpt is truncated\nsecond line";
  details.error_type = error_type;
  details.full_error_file = "/tmp/run/rank1.error.full";
  return tl::RankFailedError("trainloop: rank 1 failed: checkpoint /ckpt/epoch3.ckpt is truncated", details);
}

}  // namespace

BOOST_AUTO_TEST_CASE(every_class_of_the_table_is_rebuilt_as_itself) {
  for (const auto& entry : relayed_exceptions()) {
    BOOST_TEST(travelled_name([&] { entry.throw_plain("message"); }) == std::string(entry.name));
  }
  BOOST_CHECK_THROW(find_relayed("trainloop::CheckpointError")->throw_plain("x"), tl::CheckpointError);
  BOOST_CHECK_THROW(find_relayed("c10::OutOfMemoryError")->throw_plain("x"), c10::OutOfMemoryError);
  // A libtorch class a newer libtorch adds travels as c10::Error; an unknown class not at all.
  BOOST_TEST(std::string(find_relayed("c10::DistBackendError")->name) == "c10::Error");
  BOOST_TEST(find_relayed("std::runtime_error") == nullptr);
  BOOST_TEST(travelled_name([] { throw std::runtime_error("x"); }) == "trainloop::Error");
  BOOST_TEST(travelled_name([] { throw rank_failure("x"); }) == "trainloop::RankFailedError");
}

BOOST_AUTO_TEST_CASE(a_rank_failure_reaches_the_caller_as_the_rank_class_with_the_failure_nested) {
  try {
    try {
      throw rank_failure("trainloop::CheckpointError");
    } catch (const tl::RankFailedError& failure) {
      rethrow_rank_failure(failure);
    }
  } catch (const tl::CheckpointError& error) {
    BOOST_TEST(std::string(error.what()).find("epoch3.ckpt is truncated") != std::string::npos);
    try {
      std::rethrow_if_nested(error);
      BOOST_FAIL("no RankFailedError nested");
    } catch (const tl::RankFailedError& nested) {
      BOOST_TEST(nested.details().rank == 1);
      BOOST_TEST(nested.details().full_error_file == "/tmp/run/rank1.error.full");
    }
  }
  // A class outside the table: the RankFailedError itself.
  try {
    try {
      throw rank_failure("std::runtime_error");
    } catch (const tl::RankFailedError& failure) {
      rethrow_rank_failure(failure);
    }
  } catch (const tl::RankFailedError& error) {
    BOOST_TEST(error.details().error_type == "std::runtime_error");
  }
}

BOOST_AUTO_TEST_CASE(a_replayed_rank_failure_keeps_its_details_and_message) {
  const auto original = rank_failure("std::runtime_error");
  try {
    throw_failure_record(encode_failure_record(original), "(test)");
  } catch (const tl::RankFailedError& replayed) {
    BOOST_TEST(std::string(replayed.what()) == original.what());
    BOOST_TEST(replayed.details().rank == 1);
    BOOST_TEST(replayed.details().exit_code == 1);
    BOOST_TEST(replayed.details().signal == 0);
    BOOST_TEST(replayed.details().rank_error == original.details().rank_error);  // two lines
    BOOST_TEST(replayed.details().error_type == "std::runtime_error");
    BOOST_TEST(replayed.details().full_error_file == "/tmp/run/rank1.error.full");
  }
  const tl::CheckpointError checkpoint("trainloop: checkpoint a.ckpt is of another model\nkeys: fc.weight");
  BOOST_CHECK_EXCEPTION(throw_failure_record(encode_failure_record(checkpoint), "(test)"), tl::CheckpointError,
                        [&](const tl::CheckpointError& e) { return std::string(e.what()) == checkpoint.what(); });
  const c10::OutOfMemoryError oom("CUDA out of memory", {}, nullptr);
  BOOST_CHECK_THROW(throw_failure_record(encode_failure_record(oom), "(test)"), c10::OutOfMemoryError);
}

BOOST_AUTO_TEST_CASE(an_unreadable_record_is_a_clear_error) {
  BOOST_CHECK_EXCEPTION(throw_failure_record("garbage", "/session/fit1.failed"), tl::Error, [](const tl::Error& e) {
    const std::string text = e.what();
    return text.find("/session/fit1.failed is unreadable") != std::string::npos &&
           dynamic_cast<const tl::RankFailedError*>(&e) == nullptr;
  });
}
