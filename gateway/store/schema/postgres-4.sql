-- Schema version 4 (docs/contract.md §16): MCP tool calls. A tool call's receipt keeps its
-- `mcp` object (JSON: tool, jsonrpc_id); null for every other receipt.
ALTER TABLE receipts ADD COLUMN mcp text;
