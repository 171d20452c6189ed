#pragma once
/// @file
/// @brief Writes and reads a History as text, so a spawned rank can hand it to the launcher.

#include <trainloop/error.hpp>
#include <trainloop/history.hpp>

#include <iomanip>
#include <limits>
#include <sstream>
#include <string>

namespace trainloop::detail {

/// One line per epoch, then one per recorded step, then one per straggler record: `key value` pairs separated by tabs; metric
/// names never hold tabs. Doubles are written with max_digits10, so they read back exactly.
/// The History as text (one line per epoch, see the file comment).
inline std::string history_to_text(const History& history) {
  std::ostringstream out;
  out << std::setprecision(std::numeric_limits<double>::max_digits10);
  out << "total_steps\t" << history.total_steps << "\tstop_reason\t" << history.stop_reason << '\n';
  for (const auto& e : history.epochs) {
    out << "epoch\t" << e.epoch << "\tsteps\t" << e.steps << "\tsamples\t" << e.samples << "\ttrain_loss\t"
        << e.train_loss << "\tseconds\t" << e.seconds << "\tsamples_per_second\t" << e.samples_per_second << "\tdata_wait_seconds\t" << e.data_wait_seconds
        << "\toptimizer_state_bytes\t" << e.optimizer_state_bytes
        << "\tlr\t" << e.learning_rate;
    if (e.momentum) out << "\tmomentum\t" << *e.momentum;
    if (!e.optimizer_state_bytes_by_rank.empty()) {
      out << "\toptimizer_state_bytes_by_rank\t";
      for (size_t r = 0; r < e.optimizer_state_bytes_by_rank.size(); ++r) {
        out << (r > 0 ? "," : "") << e.optimizer_state_bytes_by_rank[r];
      }
    }
    for (const auto& [name, value] : e.train_metrics) out << "\ttrain:" << name << '\t' << value;
    if (e.validation) {
      out << "\tval_loss\t" << e.validation->loss << "\tval_samples\t" << e.validation->samples;
      for (const auto& [name, value] : e.validation->metrics) out << "\tval:" << name << '\t' << value;
    }
    out << '\n';
  }
  for (const auto& s : history.steps) {
    out << "step_record\t" << s.step << "\tin_epoch\t" << s.epoch << "\tlr\t" << s.learning_rate << "\tloss\t" << s.loss;
    if (s.momentum) out << "\tmomentum\t" << *s.momentum;
    out << '\n';
  }
  for (const auto& s : history.stragglers) {
    out << "straggler\t" << s.step << "\trank\t" << s.rank << "\tpid\t" << s.pid << "\thost\t" << s.host << "\tpart\t"
        << s.part << "\texcess_ms\t" << s.excess_ms << "\tended\t" << (s.ended ? 1 : 0) << '\n';
  }
  return out.str();
}

/// Parses what history_to_text() wrote.
inline History history_from_text(const std::string& text) {
  std::istringstream in(text);
  History history;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string key, value;
    EpochRecord record;
    bool is_epoch = false;
    if (line.rfind("step_record\t", 0) == 0) {
      StepRecord step;
      while (std::getline(fields, key, '\t') && std::getline(fields, value, '\t')) {
        if (key == "step_record") step.step = std::stoll(value);
        else if (key == "in_epoch") step.epoch = std::stoll(value);
        else if (key == "lr") step.learning_rate = std::stod(value);
        else if (key == "loss") step.loss = std::stod(value);
        else if (key == "momentum") step.momentum = std::stod(value);
      }
      history.steps.push_back(step);
      continue;
    }
    if (line.rfind("straggler\t", 0) == 0) {
      StragglerRecord straggler;
      while (std::getline(fields, key, '\t') && std::getline(fields, value, '\t')) {
        if (key == "straggler") straggler.step = std::stoll(value);
        else if (key == "rank") straggler.rank = std::stoll(value);
        else if (key == "pid") straggler.pid = std::stoll(value);
        else if (key == "host") straggler.host = value;
        else if (key == "part") straggler.part = value;
        else if (key == "excess_ms") straggler.excess_ms = std::stod(value);
        else if (key == "ended") straggler.ended = value == "1";
      }
      history.stragglers.push_back(std::move(straggler));
      continue;
    }
    while (std::getline(fields, key, '\t') && std::getline(fields, value, '\t')) {
      if (key == "total_steps") history.total_steps = std::stoll(value);
      else if (key == "stop_reason") history.stop_reason = value;
      else if (key == "epoch") { is_epoch = true; record.epoch = std::stoll(value); }
      else if (key == "steps") record.steps = std::stoll(value);
      else if (key == "samples") record.samples = std::stoll(value);
      else if (key == "train_loss") record.train_loss = std::stod(value);
      else if (key == "seconds") record.seconds = std::stod(value);
      else if (key == "samples_per_second") record.samples_per_second = std::stod(value);
      else if (key == "data_wait_seconds") record.data_wait_seconds = std::stod(value);  // absent in older files: 0
      else if (key == "optimizer_state_bytes") record.optimizer_state_bytes = std::stoll(value);  // older files: 0
      else if (key == "optimizer_state_bytes_by_rank") {
        std::istringstream ranks(value);
        for (std::string bytes; std::getline(ranks, bytes, ',');) record.optimizer_state_bytes_by_rank.push_back(std::stoll(bytes));
      }
      else if (key == "lr") record.learning_rate = std::stod(value);
      else if (key == "momentum") record.momentum = std::stod(value);
      else if (key.rfind("train:", 0) == 0) record.train_metrics[key.substr(6)] = std::stod(value);
      else if (key == "val_loss") { record.validation.emplace(); record.validation->loss = std::stod(value); }
      else if (key == "val_samples") record.validation->samples = std::stoll(value);
      else if (key.rfind("val:", 0) == 0) record.validation->metrics[key.substr(4)] = std::stod(value);
    }
    if (is_epoch) history.epochs.push_back(std::move(record));
  }
  return history;
}

}  // namespace trainloop::detail
