#!/usr/bin/env python3
"""Writes what GPU checklist item 6 trains in C++ (scripts/gpu-check.sh step `models`), from
torchvision's models with the Python torch of the GPU machine (no network, no timm there):

    python3 scripts/gpu-check-models.py OUT_DIR [--size 224] [--images 64]

OUT_DIR/resnet18.pt2   torch.export of torchvision's resnet18 (10 classes, train mode, dynamic batch)
OUT_DIR/resnet18.pt    torch.jit.script of the same architecture
OUT_DIR/resnet50.pth   a state_dict of torchvision's resnet50 (10 classes, seeded random weights)
OUT_DIR/images/        an image folder of PPM files (train/ and test/, 10 classes, --images per class
                       and split): PPM needs neither libjpeg nor libpng, which the GPU machine lacks
"""
import argparse
import os

import torch
import torchvision


def write_ppm(path, pixels):
    height, width, _ = pixels.shape
    with open(path, "wb") as f:
        f.write(b"P6\n%d %d\n255\n" % (width, height))
        f.write(pixels.contiguous().numpy().tobytes())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--images", type=int, default=64)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10).train()
    batch = torch.export.Dim("batch", min=1, max=4096)
    example = torch.randn(2, 3, args.size, args.size)
    program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},))
    torch.export.save(program, os.path.join(args.out, "resnet18.pt2"))
    torch.jit.script(torchvision.models.resnet18(num_classes=10)).save(os.path.join(args.out, "resnet18.pt"))
    torch.save(torchvision.models.resnet50(num_classes=10).state_dict(), os.path.join(args.out, "resnet50.pth"))
    # Each class a different mean colour plus noise: learnable, so accuracy says training happened.
    generator = torch.Generator().manual_seed(1)
    side = args.size + args.size // 7  # larger than the crop, as photographs are
    for split in ("train", "test"):
        for label in range(10):
            folder = os.path.join(args.out, "images", split, f"class{label}")
            os.makedirs(folder, exist_ok=True)
            colour = torch.tensor([(label * 37) % 256, (label * 91) % 256, (label * 151) % 256], dtype=torch.float32)
            for i in range(args.images):
                noise = torch.randn(side, side, 3, generator=generator) * 40
                write_ppm(os.path.join(folder, f"{i}.ppm"), (colour + noise).clamp(0, 255).to(torch.uint8))
    print(f"{args.out}: resnet18.pt2, resnet18.pt, resnet50.pth, images ({args.images} per class and split, {side} px)")


if __name__ == "__main__":
    main()
