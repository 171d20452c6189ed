#pragma once
/// @file
/// @brief The umbrella header: everything a trainloop user needs.

#include <trainloop/version.hpp>

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/callbacks/csv_logger.hpp>
#include <trainloop/callbacks/model_checkpoint.hpp>
#include <trainloop/callbacks/progress_bar.hpp>
#include <trainloop/callbacks/tensorboard_logger.hpp>
#include <trainloop/callbacks/training_plot.hpp>
#include <trainloop/cpu/allocator.hpp>
#include <trainloop/cpu/threads.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/fashion_mnist.hpp>
#include <trainloop/data/image_folder.hpp>
#include <trainloop/data/tensor_dataset.hpp>
#include <trainloop/error.hpp>
#include <trainloop/distributed/rank_session.hpp>
#include <trainloop/gpu_mode/data_parallel.hpp>
#include <trainloop/gpu_mode/distributed.hpp>
#include <trainloop/gpu_mode/parse.hpp>
#include <trainloop/gpu_mode/single.hpp>
#include <trainloop/history.hpp>
#include <trainloop/metrics/accuracy.hpp>
#include <trainloop/metrics/metric.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/options.hpp>
#include <trainloop/train_loop.hpp>
