"""Decoding a JSON file's bytes into one-line reasons: what the plan and profile loaders share."""

from __future__ import annotations

import json


class JsonFileError(ValueError):
    """Why bytes are not a JSON document, as the end of a sentence about the file."""


def decode_json(raw: bytes, noun: str) -> object:
    """The JSON document in ``raw`` (UTF-8, an optional BOM); a ``JsonFileError`` whose message
    completes "<the file> ..." when it is not UTF-8, nests too deeply for a ``noun``, holds an
    integer beyond Python's 4,300-digit limit, or is not JSON."""
    try:
        return json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as exc:
        raise JsonFileError(f"is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except RecursionError:
        raise JsonFileError(f"nests JSON too deeply to be a {noun}") from None
    except ValueError as exc:  # JSONDecodeError, or an integer of over 4,300 digits
        if "Exceeds the limit" in str(exc):
            raise JsonFileError("holds an integer of over 4,300 digits; no figure is that large") from None
        raise JsonFileError(f"is not valid JSON: {' '.join(str(exc).split())[:200]}") from None
