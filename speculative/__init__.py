"""specd's decoding algorithms: strategies, draft trees, budgets, verification, sampling,
grammars and tool calls, the prefix cache, batching, n-gram drafting. A model is seen only
through modeling/protocol.py (a pass, a new cache, its vocabulary width, device and dtype);
of the runtime it imports only that, the KV cache, the text modules and `RequestError`
(tests/test_layering.py). Nothing here knows HTTP or offload."""
