#pragma once
// Boost.Test for every test program: the compiled library where it is installed (Debian's
// libboost-test-dev), or the header-only form where only the headers are (the GPU machines,
// which carry Boost's headers but no Debian packages). tests/CMakeLists.txt decides and sets
// TRAINLOOP_BOOST_TEST_HEADER_ONLY. Include this after `#define BOOST_TEST_MODULE name`.
#ifdef TRAINLOOP_BOOST_TEST_HEADER_ONLY
#include <boost/test/included/unit_test.hpp>
#else
#include <boost/test/unit_test.hpp>
#endif
