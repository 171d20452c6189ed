#!/usr/bin/env python3
"""Exports a timm model as a torch.export program that trainloop trains in C++
(interop::ExportedProgram, or `image_classifier --exported`):

    python examples/export_timm_model.py resnet18 --classes 10 --size 128 --out resnet18.pt2
    build/examples/image_classifier --data ROOT --size 128 --exported resnet18.pt2 --export trained.pt2

The model is exported in train mode (trainloop derives eval mode from it: BatchNorm on running
statistics, dropout off) with a dynamic batch dimension, so the last, smaller batch of an epoch
and any evaluation batch size run. Back in Python, the trained weights load into the same model:

    program = torch.export.load("trained.pt2")
    model = timm.create_model("resnet18", num_classes=10)
    model.load_state_dict(program.state_dict, strict=True)

Needs torch >= 2.11 (the export schema 8.x trainloop reads) and timm; --pretrained downloads
timm's weights from the Hugging Face hub, without it the weights are random.
"""
import argparse

import timm
import torch


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('model', help="a timm model name, e.g. resnet18, efficientnet_b0, convnext_atto")
    parser.add_argument('--classes', type=int, default=10, help='outputs of the classifier head')
    parser.add_argument('--size', type=int, default=128, help='image size of the example input (and of ViTs)')
    parser.add_argument('--pretrained', action='store_true', help="timm's pretrained weights (a download)")
    parser.add_argument('--out', required=True, help='the .pt2 file to write')
    args = parser.parse_args()

    kwargs = dict(num_classes=args.classes, pretrained=args.pretrained)
    if 'vit' in args.model or 'deit' in args.model:
        kwargs['img_size'] = args.size  # a ViT's position embedding is sized for one image size
    model = timm.create_model(args.model, **kwargs).train()
    example = torch.randn(2, 3, args.size, args.size)
    batch = torch.export.Dim('batch', min=1, max=4096)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, args.out)
    parameters = sum(p.numel() for p in model.parameters())
    print(f'{args.out}: {args.model}, {parameters:,} parameters, {len(program.graph.nodes)} graph nodes, batch 1-4096')


if __name__ == '__main__':
    main()
