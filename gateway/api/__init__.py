"""The gateway's own HTTP API under /_gateway/."""
