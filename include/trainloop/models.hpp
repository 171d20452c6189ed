#pragma once
/// @file
/// @brief The model zoo: torchvision's ResNets and fastai's XResNets under their origin's
/// state_dict names, ImageClassifier to choose one by name at run time, and fastai's split of
/// each into parameter groups for fine-tuning (models::fastai_split).

#include <trainloop/finetune/zoo_splits.hpp>
#include <trainloop/models/batch_norm_layer.hpp>
#include <trainloop/models/image_model_options.hpp>
#include <trainloop/models/resnet.hpp>
#include <trainloop/models/resnet_blocks.hpp>
#include <trainloop/models/xresnet.hpp>
#include <trainloop/models/xresnet_block.hpp>
#include <trainloop/models/zoo.hpp>
