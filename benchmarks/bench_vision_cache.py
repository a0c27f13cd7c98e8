"""The vision cache, measured (issue 47.3): the same image asked about again, against running servers.

    python benchmarks/bench_vision_cache.py --target ours=http://127.0.0.1:8100 \
        --target mlx_vlm=http://127.0.0.1:8101 --size 1024 --repeats 3 --out vision_cache.json

Per repeat, a new image (a pattern of its own, `--size` pixels square, PNG; `--media video`: an
8-frame MP4 of it moving, or `both`; a data URL, or for a target named by `--video-as-file` a file
on this machine, the same bytes), three requests to each target, streamed, each answered in full
before the next:
1. `cold`: a new conversation asking about the image (the vision tower encodes it);
2. `new_conversation`: another new conversation about the same image (its encoder features can be
   reused by content: ours keeps them by the image's hash, `vision_cache_hits_total`);
3. `same_conversation`: the first conversation's next turn (its prompt, image included, can be
   restored from the prefix cache: `cached_tokens`).
Targets alternate repeat by repeat (ABBA), so drift cancels. The report: per request its TTFT,
prompt and cached tokens, and where the server has them the vision cache's hits during it (from
`/metrics`); per target, medium and case the TTFT median (min-max) and its ratio to `cold` (a
target that fails a request: its status and the case, once). JSON `runs`: one entry per request.
"""

from __future__ import annotations

import argparse
import base64
import importlib.util
import io
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

CASES = ("cold", "new_conversation", "same_conversation")


def image_url(size: int, seed: int) -> str:
    """A `size` x `size` PNG of seeded bars and discs, as a data URL (another seed, another image)."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(24):
        x, y = rng.randrange(size), rng.randrange(size)
        w, h = rng.randrange(size // 16, size // 3), rng.randrange(size // 16, size // 3)
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x, y, x + w, y + h), fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def video_bytes(size: int, seed: int, frames: int = 8, fps: float = 2.0) -> bytes:
    """A `frames`-frame MP4 (`fps`, `size` pixels square) of the seeded pattern moving (OpenCV writes
    it, as the server's decoder reads it)."""
    import os
    import tempfile

    import cv2
    import numpy as np
    from PIL import Image

    base = np.array(Image.open(io.BytesIO(base64.b64decode(image_url(size, seed).split(",", 1)[1]))))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "clip.mp4")
        writer = cv2.VideoWriter(path, cv2.VideoWriter_fourcc(*"mp4v"), fps, (size, size))
        for k in range(frames):
            writer.write(np.ascontiguousarray(np.roll(base, k * size // (4 * frames), axis=1)[:, :, ::-1]))
        writer.release()
        with open(path, "rb") as f:
            return f.read()


def video_url(size: int, seed: int, as_file: str | None = None) -> str:
    """`video_bytes` as a data URL, or (`as_file`: a directory) written there and given by its path, for a
    server on this machine that takes no data URL for a video (mlx_vlm.server 0.7.10: "Cannot open video")."""
    data = video_bytes(size, seed)
    if as_file is None:
        return "data:video/mp4;base64," + base64.b64encode(data).decode()
    path = Path(as_file) / f"clip-{size}-{seed}.mp4"
    path.write_bytes(data)
    return str(path)


def vision_hits(url: str) -> float | None:
    """`mlx_relay:vision_cache_hits_total`, None where the server has no such metric."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("mlx_relay:vision_cache_hits_total")]
    return sum(values) if values else None


def ask(url: str, model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One streamed request: TTFT, the reply's text and the usage the server reports."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = event.get("usage") or usage
    details = usage.get("prompt_tokens_details") or {}
    return {"ttft_s": ttft, "text": "".join(text), "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens")}


def run_repeat(name: str, url: str, repeat: int, size: int, max_tokens: int, media: str = "image",
               video_dir: str | None = None) -> list[dict[str, Any]]:
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    part = ({"type": "image_url", "image_url": {"url": image_url(size, repeat)}} if media == "image"
            else {"type": "video_url", "video_url": {"url": video_url(size, repeat, video_dir)}})
    first = [{"role": "user", "content": [part, {"type": "text", "text": f"Describe this {media} in one sentence."}]}]
    other = [{"role": "user", "content": [part, {"type": "text", "text": f"Which colours are in this {media}?"}]}]
    out: list[dict[str, Any]] = []
    cold: dict[str, Any] = {}
    for case in CASES:
        if case == "cold":
            messages = first
        elif case == "new_conversation":
            messages = other
        else:
            messages = [*first, {"role": "assistant", "content": cold["text"]},
                        {"role": "user", "content": "And which shapes?"}]
        hits = vision_hits(url)
        try:
            got = ask(url, model, messages, max_tokens)
        except httpx.HTTPStatusError as exc:  # a server that takes no video says so: recorded, not measured
            out.append({"target": name, "repeat": repeat, "media": media, "case": case, "size": size,
                        "ttft_s": None, "error": f"{exc.response.status_code}"})
            break
        after = vision_hits(url)
        if case == "cold":
            cold = got
        out.append({"target": name, "repeat": repeat, "media": media, "case": case, "size": size,
                    "ttft_s": got["ttft_s"], "prompt_tokens": got["prompt_tokens"],
                    "cached_tokens": got["cached_tokens"],
                    "vision_cache_hits": None if hits is None or after is None else after - hits})
    return out


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for target, media in dict.fromkeys((r["target"], r.get("media", "image")) for r in runs):
        ours = [r for r in runs if r["target"] == target and r.get("media", "image") == media]
        errors = [r for r in ours if r.get("error")]
        if errors:
            rows.append({"target": target, "media": media, "case": "error", "error": errors[0]["error"],
                         "at": errors[0]["case"], "n": len(errors)})
        cold = [r["ttft_s"] for r in ours if r["case"] == "cold" and r["ttft_s"]]
        for case in CASES:
            mine = [r for r in ours if r["case"] == case and r["ttft_s"]]
            if not mine:
                continue
            ttfts = [r["ttft_s"] for r in mine]
            hits = [r["vision_cache_hits"] for r in mine if r["vision_cache_hits"] is not None]
            rows.append({"target": target, "media": media, "case": case,
                         "ttft_s": round(statistics.median(ttfts), 4),
                         "ttft_min_s": round(min(ttfts), 4), "ttft_max_s": round(max(ttfts), 4),
                         "vs_cold": round(statistics.median(ttfts) / statistics.median(cold), 3) if cold else None,
                         "cached_tokens": statistics.median(r["cached_tokens"] or 0 for r in mine),
                         "prompt_tokens": statistics.median(r["prompt_tokens"] or 0 for r in mine),
                         "vision_cache_hits": sum(hits) if hits else None, "n": len(mine)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", action="append", required=True, metavar="NAME=URL")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--media", default="image", help="image, video or both (a short MP4; OpenCV writes it)")
    parser.add_argument("--video-as-file", action="append", default=[], metavar="NAME",
                        help="this target gets the video as a file path on this machine (the same bytes)")
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    targets = [t.split("=", 1) for t in args.target]
    runs: list[dict[str, Any]] = []
    medias = ("image", "video") if args.media == "both" else (args.media,)
    if "video" in medias and importlib.util.find_spec("cv2") is None:
        print("no OpenCV here to write the video: images only")
        medias = tuple(m for m in medias if m != "video")
    with tempfile.TemporaryDirectory() as videos:
        for repeat in range(args.repeats):
            order = targets if repeat % 2 == 0 else targets[::-1]
            for media in medias:
                for name, url in order:
                    runs += run_repeat(name, url, repeat, args.size, args.max_tokens, media,
                                       videos if name in args.video_as_file else None)
    rows = summarize(runs)
    print("| target | media | case | TTFT s median (min-max) | x cold | prompt | cached | vision cache hits |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["case"] == "error":
            print(f"| {r['target']} | {r['media']} | HTTP {r['error']} at {r['at']} ({r['n']}x) | | | | | |")
            continue
        print(f"| {r['target']} | {r['media']} | {r['case']} | {r['ttft_s']:.3f} ({r['ttft_min_s']:.3f}-"
              f"{r['ttft_max_s']:.3f}) | {r['vs_cold']} | {r['prompt_tokens']:g} | {r['cached_tokens']:g} | "
              f"{r['vision_cache_hits']} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"commit": args.commit, "size": args.size, "repeats": args.repeats, "rows": rows, "runs": runs},
                      f, indent=1)


if __name__ == "__main__":
    main()
