"""The OpenAI-style HTTP server and the `tightfit serve` command. Imports engine and below."""
