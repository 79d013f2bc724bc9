"""Recreate gutenberg/calibration.txt from the full corpus (documents how it was cut).

    python -m slimlm.assets.cut_calibration ../shared/data/corpus/gutenberg_30books_bodies.txt

The books are located with gutenberg_MANIFEST.json beside the corpus (each book's body_chars;
books are joined by three newlines). From each book, skip the first 10,000 characters (title
pages, contents) and keep the following whole paragraphs, up to 60,000 characters.
"""

import json
import sys
from pathlib import Path

SKIP_CHARS = 10_000
KEEP_CHARS = 60_000


def cut(corpus: str, book_lengths: list[int]) -> str:
    pieces = []
    position = 0
    for length in book_lengths:
        body = corpus[position + SKIP_CHARS : position + length]
        position += length + 3
        start = body.find("\n\n") + 2  # begin at a paragraph
        end = body.rfind("\n\n", start, start + KEEP_CHARS)  # end at a paragraph
        pieces.append(body[start:end].strip())
    return "\n\n\n".join(pieces) + "\n"


if __name__ == "__main__":
    corpus_path = Path(sys.argv[1])
    manifest = json.loads((corpus_path.parent / "gutenberg_MANIFEST.json").read_text())
    text = cut(corpus_path.read_text(encoding="utf-8"), [book["body_chars"] for book in manifest])
    out = Path(__file__).parent / "gutenberg" / "calibration.txt"
    out.write_text(text, encoding="utf-8")
    print(f"{out}: {len(text.encode())} bytes")
