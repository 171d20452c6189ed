#!/usr/bin/python3
"""image_pipeline (torchvision side): images per second through torchvision's ImageFolder +
DataLoader with the same augmentation as benchmarks/image_pipeline.cpp (RandomResizedCrop,
RandomHorizontalFlip, ToTensor, Normalize), shuffled batches, no training.

    /usr/bin/python3 benchmarks/image_pipeline_torchvision.py --data DIR --workers 2 --size 224
Prints  RESULT torchvision workers <w> images_per_second <v>
"""
import argparse
import statistics
import time

import torch
import torchvision
from torchvision import transforms


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=1)
    args = parser.parse_args()
    augment = transforms.Compose([
        transforms.RandomResizedCrop(args.size), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    folder = torchvision.datasets.ImageFolder(args.data, augment)
    loader = torch.utils.data.DataLoader(folder, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    rates = []
    for repetition in range(args.repetitions):
        seen, start = 0, time.perf_counter()
        for images, _ in loader:
            seen += images.shape[0]
        seconds = time.perf_counter() - start
        rates.append(seen / seconds)
        print(f"pass {repetition + 1}: {seen} images in {seconds:.2f} s, {rates[-1]:.1f} images/s", flush=True)
    print(f"RESULT torchvision workers {args.workers} images_per_second {statistics.median(rates):.1f}")


if __name__ == "__main__":
    main()
