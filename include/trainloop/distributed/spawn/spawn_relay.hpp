#pragma once
/// @file
/// @brief DistributedDataParallel in a plain program: fit() re-executes the program once per
/// rank and relays the model, the optimizer and the History between the caller and its ranks.
///
/// The launching process (the caller) numbers its DDP fit() calls 1, 2, ... For call k it writes
/// a checkpoint of the loop ("initial.ckpt": model, optimizer, progress, callbacks' states),
/// starts the ranks with TRAINLOOP_FIT_INDEX=k, waits, and loads the checkpoint rank 0 wrote at
/// the end ("trained.ckpt") into the loop. A rank runs the program from the top: it passes calls
/// 1..k-1 (each loads the state the caller had right after that call and returns its History,
/// so code between fits sees in every rank what the caller saw), trains call k from
/// "initial.ckpt", writes "trained.ckpt", and ends; the rest of the program runs in the caller.
///
/// Files: a session directory per launching process ($TMPDIR/trainloop-session-\<pid\>-XXXXXX,
/// removed when the process exits, or by the next launcher if it was killed) keeps the state
/// after each call (fit\<k\>.ckpt); each launch's run directory lives inside it.

///
/// One header per job: spawn_session.hpp (the session directory and the records of earlier
/// calls), spawn_launching_side.hpp (the caller), spawn_rank_side.hpp (a spawned rank), and
/// relayed_exceptions.hpp (the exception classes that travel between them, in one table).

#include <trainloop/distributed/spawn/relayed_exceptions.hpp>
#include <trainloop/distributed/spawn/spawn_launching_side.hpp>
#include <trainloop/distributed/spawn/spawn_rank_side.hpp>
#include <trainloop/distributed/spawn/spawn_session.hpp>
