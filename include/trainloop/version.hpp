#pragma once
/// @file
/// @brief trainloop's version, as numbers and as the string stamped into checkpoints.

/// Major version: changes break the API.
#define TRAINLOOP_VERSION_MAJOR 0
/// Minor version: additions.
#define TRAINLOOP_VERSION_MINOR 2
/// Patch version: fixes.
#define TRAINLOOP_VERSION_PATCH 0
/// The version as one number: major * 10000 + minor * 100 + patch.
#define TRAINLOOP_VERSION (TRAINLOOP_VERSION_MAJOR * 10000 + TRAINLOOP_VERSION_MINOR * 100 + TRAINLOOP_VERSION_PATCH)

/// Turns a macro argument into a string literal (helper of TRAINLOOP_VERSION_STRING).
#define TRAINLOOP_STRINGIFY_IMPL(x) #x
/// Expands a macro, then turns it into a string literal.
#define TRAINLOOP_STRINGIFY(x) TRAINLOOP_STRINGIFY_IMPL(x)
/// The version as "major.minor.patch".
#define TRAINLOOP_VERSION_STRING                                                             \
  TRAINLOOP_STRINGIFY(TRAINLOOP_VERSION_MAJOR) "." TRAINLOOP_STRINGIFY(TRAINLOOP_VERSION_MINOR) "." \
      TRAINLOOP_STRINGIFY(TRAINLOOP_VERSION_PATCH)
