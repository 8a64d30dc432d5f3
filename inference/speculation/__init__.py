"""Draft-free speculative decoding: n-gram proposals from a request's own tokens, its siblings and
earlier samples of its prompt (`proposer`, `history`), and exact-match verification (`verify`)."""
