"""Index a repository's files through `/v1/embeddings` and answer a nearest-neighbour query: the
one-page example of docs/embeddings.md (issue 47.1).

    mlx-relay serve --embedding-model Qwen/Qwen3-Embedding-0.6B        # beside the default model
    python docs/examples/index_repo.py --url http://127.0.0.1:8000/v1 --model Qwen3-Embedding-0.6B \\
        "where does the engine decide how long a prefill slice is?"

Each file (`--glob`, default Python and Markdown) is cut into pieces of `--lines` lines; every
piece is embedded (OpenAI's SDK, `--batch` pieces a request), the query too, and the pieces
nearest to it by cosine similarity (the vectors are unit length: a dot product) are printed with
their place. Qwen3-Embedding reads a query best with its instruction (`--instruct`); documents
go in as they are.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from openai import OpenAI

INSTRUCT = "Given a question about a codebase, retrieve the code or documentation that answers it"


def pieces(root: Path, patterns: list[str], lines: int) -> list[tuple[str, str]]:
    """(place, text) for every `lines`-line piece of the files under `root` matching `patterns`."""
    out = []
    for pattern in patterns:
        for path in sorted(root.rglob(pattern)):
            if any(part.startswith(".") for part in path.relative_to(root).parts):
                continue
            text = path.read_text(errors="replace").splitlines()
            for start in range(0, len(text), lines):
                chunk = "\n".join(text[start:start + lines]).strip()
                if chunk:
                    out.append((f"{path.relative_to(root)}:{start + 1}", f"{path.name}\n{chunk}"))
    return out


def embed(client: OpenAI, model: str, texts: list[str], batch: int) -> np.ndarray:
    vectors = []
    for i in range(0, len(texts), batch):
        got = client.embeddings.create(model=model, input=texts[i:i + batch])
        vectors += [d.embedding for d in got.data]
    return np.array(vectors, dtype=np.float32)


def search(client: OpenAI, model: str, index: np.ndarray, places: list[str], query: str, k: int,
           instruct: str | None = INSTRUCT) -> list[tuple[float, str]]:
    text = f"Instruct: {instruct}\nQuery: {query}" if instruct else query
    q = embed(client, model, [text], 1)[0]
    scores = index @ q
    return [(float(scores[i]), places[i]) for i in np.argsort(-scores)[:k]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("query")
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--model", required=True, help="the embedding model's name on the server")
    ap.add_argument("--root", type=Path, default=Path("."))
    ap.add_argument("--glob", default="*.py,*.md")
    ap.add_argument("--lines", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("-k", type=int, default=5)
    ap.add_argument("--instruct", default=INSTRUCT, help="the query's instruction ('' for none)")
    args = ap.parse_args()
    client = OpenAI(base_url=args.url, api_key="none")
    found = pieces(args.root, args.glob.split(","), args.lines)
    index = embed(client, args.model, [text for _, text in found], args.batch)
    print(f"indexed {len(found)} pieces of {args.root.resolve()}")
    for score, place in search(client, args.model, index, [p for p, _ in found], args.query, args.k,
                               args.instruct or None):
        print(f"{score:.3f}  {place}")


if __name__ == "__main__":
    main()
