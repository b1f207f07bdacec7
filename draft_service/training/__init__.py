"""Training data and training for the trained drafts of issue 3 (EAGLE-style drafter, Medusa heads, distilled LM).

- ``prompts``: a seeded synthetic chat-prompt generator (no prompt overlaps bench/prompts.jsonl).
- ``generate_data``: the target's greedy responses + final hidden states + greedy next tokens, in shards.
- ``dataset``: reads those shards back, one sequence at a time.
"""
