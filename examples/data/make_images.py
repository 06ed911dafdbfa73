"""Writes the sample image data set: examples/data/images/*.png and mllm_demo.json.

Twelve 64x64 pictures of a coloured shape (circle, square, triangle in red, green, blue,
yellow) and, for each, a conversation about it in the sharegpt `messages` format with an
`images` column (LLaMA-Factory's multimodal convention). Run it again to regenerate them:

    python examples/data/make_images.py
"""
from __future__ import annotations

import json
from pathlib import Path

from PIL import Image, ImageDraw

HERE = Path(__file__).resolve().parent
COLORS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30)}
SHAPES = ("circle", "square", "triangle")


def draw(shape: str, rgb: tuple[int, int, int]) -> Image.Image:
    image = Image.new("RGB", (64, 64), "white")
    d = ImageDraw.Draw(image)
    if shape == "circle":
        d.ellipse((12, 12, 52, 52), fill=rgb)
    elif shape == "square":
        d.rectangle((14, 14, 50, 50), fill=rgb)
    else:
        d.polygon([(32, 10), (54, 52), (10, 52)], fill=rgb)
    return image


def main() -> None:
    (HERE / "images").mkdir(exist_ok=True)
    records = []
    for k, (color, rgb) in enumerate(COLORS.items()):
        for j, shape in enumerate(SHAPES):
            name = f"images/{color}_{shape}.png"
            draw(shape, rgb).save(HERE / name)
            if (k + j) % 3 == 0:   # some two-turn conversations, the image in the first turn
                messages = [{"role": "user", "content": "<image>What shape is in this picture?"},
                            {"role": "assistant", "content": f"A {shape}."},
                            {"role": "user", "content": "And what color is it?"},
                            {"role": "assistant", "content": f"It is {color}."}]
            else:
                messages = [{"role": "user", "content": "<image>Describe this picture."},
                            {"role": "assistant", "content": f"A {color} {shape} on a white background."}]
            records.append({"messages": messages, "images": [name]})
    (HERE / "mllm_demo.json").write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
