"""The page's example prompts, each labelled with what this model really gives for it.

Checked by decoding each candidate with the embedded SmolLM2-135M-Instruct, greedy, 64 new tokens, in
float32 and bfloat16, each in every form the tuner may pick (issue 25; `tests/test_first_minutes.py` keeps
checking it), since greedy output depends on the numerics. What decides whether the answer is code:
- a function header with the first line of its body, continued as raw text: code (the default example);
- a bare header: code in float32, commented-out lines in bfloat16 (the former default, a palindrome check);
- a header plus a docstring, or a finished function followed by the next header: "```" and a paragraph
  of prose, so none here;
- a chat request for a function: a fenced code block;
- an HTML page begun as raw text: the rest of the page, then a sentence of prose;
- a chat request for an HTML page: broken markup, so none here.
"""

from __future__ import annotations

# [prompt, chat] rows for gr.Examples (inputs: the prompt box and the chat checkbox), and their labels.
EXAMPLES = [
    ["def count_vowels(word):\n    count = 0\n", False],
    ["Write a Python function that checks whether a number is prime.", True],
    ["<!DOCTYPE html>\n<html>\n<head>\n  <title>My to-do list</title>\n</head>\n<body>\n  <h1>My to-do list</h1>\n"
     "  <ul>\n    <li>", False],
    ["What is the capital of France, and what is it famous for?", True],
]
EXAMPLE_LABELS = [
    "vowel count: code completion → code",
    "prime check: chat request → code",
    "to-do page: HTML completion → HTML",
    "Paris: chat question → prose",
]

# Messages for the Chat tab.
CHAT_EXAMPLES = [
    ["Write a Python function that checks whether a number is prime."],
    ["Write a Python class Stack with push, pop and peek methods."],
    ["What is the capital of France, and what is it famous for?"],
]
