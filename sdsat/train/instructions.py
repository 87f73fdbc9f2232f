"""Varied chat instructions for a self-distillation corpus, all from what the machine holds.

The template set of `data.chat_instructions` is 10 tasks over 34 topics: a head trained on its answers
learns those answers, not chat. These instructions spread over what people ask a small assistant:
  * explanations, comparisons, advice and lists over a few hundred everyday and technical topics;
  * writing: messages, notes, stories and poems for everyday situations;
  * code: small functions, classes, queries and scripts in several languages;
  * the shell: every command with a manual page here (its one-line summary from the page's NAME section);
  * software: what each installed Debian package is for (its one-line description).
The sources take turns, so every early stretch of the corpus holds each of them; the largest outlasts the
others and has the list's tail to itself.
"""

from __future__ import annotations

import gzip
import itertools
import random
import re
import zlib
from pathlib import Path

_EXPLAIN = [
    "Explain {} in simple terms.", "Tell me briefly about {}.", "Give me a quick overview of {}.",
    "Why should I care about {}?", "What are the pros and cons of {}?", "List three facts about {}.",
    "How would you describe {} to a ten-year-old?", "What are common misconceptions about {}?",
    "Write a short paragraph about {}.", "What should a beginner know about {}?",
    "Give me three tips related to {}.", "Summarize the history of {} in a few sentences.",
    "What questions should I ask to understand {} better?", "Compare {} with something similar.",
]
_TOPICS = [
    "photosynthesis", "the water cycle", "inflation", "compound interest", "vaccines", "black holes",
    "the immune system", "sleep", "meditation", "climate change", "renewable energy", "electric cars",
    "the stock market", "credit scores", "budgeting", "remote work", "job interviews", "negotiating a salary",
    "learning to cook", "baking bread", "coffee brewing", "tea", "gardening", "composting", "houseplants",
    "running a marathon", "strength training", "stretching", "a balanced diet", "vitamins", "hydration",
    "the Roman Empire", "the Renaissance", "the Industrial Revolution", "the printing press", "the Cold War",
    "the moon landing", "ancient Egypt", "the Silk Road", "democracy", "elections", "human rights",
    "plate tectonics", "earthquakes", "hurricanes", "the ocean's tides", "coral reefs", "rainforests",
    "bees", "migratory birds", "dinosaurs", "evolution", "DNA", "cells", "antibiotics", "the human heart",
    "the brain", "memory", "habits", "motivation", "procrastination", "stress", "friendship", "parenting",
    "learning a language", "reading more books", "public speaking", "writing clearly", "note taking",
    "time management", "productivity apps", "email etiquette", "meetings", "project management", "agile",
    "open source", "the internet", "Wi-Fi", "cloud computing", "encryption", "passwords", "phishing",
    "two-factor authentication", "databases", "SQL indexes", "caching", "load balancing", "microservices",
    "containers", "virtual machines", "operating systems", "compilers", "garbage collection", "recursion",
    "Big-O notation", "hash tables", "linked lists", "binary trees", "graphs", "sorting algorithms",
    "dynamic programming", "floating-point numbers", "Unicode", "regular expressions", "version control",
    "code review", "unit testing", "continuous integration", "technical debt", "APIs", "REST", "JSON",
    "machine learning", "neural networks", "overfitting", "large language models", "statistics",
    "probability", "averages and medians", "prime numbers", "fractions", "geometry", "the Pythagorean theorem",
    "music theory", "learning the guitar", "photography", "painting with watercolors", "chess",
    "board games", "video game design", "film editing", "poetry", "science fiction", "mythology",
    "traveling on a budget", "packing for a trip", "camping", "hiking safety", "visiting Paris",
    "a trip to Japan", "moving to a new city", "renting an apartment", "buying a used car", "bicycle repair",
    "recycling", "minimalism", "volunteering", "adopting a dog", "caring for a cat", "first aid",
]
_WRITE = [
    "Write a short, friendly message about {}.", "Draft a polite email about {}.", "Write a two-line note about {}.",
    "Write a short story about {}.", "Write a four-line poem about {}.", "Write a limerick about {}.",
    "Give me a catchy title for an article about {}.", "Write a tweet-length post about {}.",
]
_SITUATIONS = [
    "thanking a friend for a gift", "asking my manager for a day off", "inviting neighbours to a barbecue",
    "apologizing for missing a meeting", "welcoming a new colleague", "declining an invitation",
    "reminding a client about an unpaid invoice", "congratulating a coworker on a promotion",
    "asking a teacher about homework", "announcing an office move", "learning to swim as an adult",
    "a rainy Monday morning", "finding a lost key", "the first day of spring", "a cat that loves boxes",
    "a robot learning to paint", "a lighthouse keeper", "a city at night", "a long train journey",
    "a bug that only appears on Fridays", "a programmer's first day", "a surprise birthday party",
]
_CODE = [
    "Write a Python function that {}.", "I need a Python function that {}. Can you help?",
    "Write a JavaScript function that {}.", "Write a Rust function that {}.", "Write a C function that {}.",
    "Write a short program that {}, and explain how it works.", "Write a Go function that {}.",
    "Write a Python function that {}, with a docstring and one example call.",
]
_ACTIONS = [
    "reverses the words in a sentence", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts how often each word appears in a text", "finds the second largest number in a list",
    "flattens a nested list", "removes duplicate items while keeping their order", "validates an email address",
    "converts Celsius to Fahrenheit", "reads a JSON file and prints its keys", "parses a date string",
    "computes the median of a list", "splits a list into chunks of a given size", "rotates a matrix",
    "generates the Fibonacci numbers up to n", "checks whether two words are anagrams", "capitalizes every word",
    "downloads a web page and counts its links", "keeps a running average", "implements a simple stack",
    "implements a queue with two stacks", "measures how long a function takes", "caches a function's results",
    "writes rows to a CSV file", "walks a directory and lists large files", "retries a failing network call",
    "sums the digits of a number", "converts a number to Roman numerals", "finds the longest common prefix",
    "groups people by their age", "sorts a list of dictionaries by a key", "checks balanced parentheses",
]
_SHELL = [
    "How do I use `{0}` ({1})?", "What does the `{0}` command do? Show one example.",
    "Explain the `{0}` command ({1}) in two sentences.", "Give me a practical example of `{0}`.",
]
_SOFTWARE = ["What is {0} used for? It is described as: {1}.", "When would I install {0} ({1})?"]


def man_summaries(folder: Path = Path("/usr/share/man/man1")) -> list[tuple[str, str]]:
    """(command, one-line summary) from the NAME sections of the manual pages here (none where there are none)."""
    found = {}
    for path in sorted(folder.glob("*.gz")):
        try:
            text = gzip.decompress(path.read_bytes())[:20_000].decode("utf-8", "replace")
        except (OSError, EOFError, gzip.BadGzipFile, zlib.error):
            continue
        match = re.search(r'^\.S[Hh] "?NAME"?\s*\n(?:\.[^\n]*\n)*([^.\n][^\n]*)', text, re.M)
        if not match or " \\- " not in match.group(1):
            continue
        names, summary = match.group(1).split(" \\- ", 1)
        name, summary = (re.sub(r"\\f[BIRP]|\\", "", part).strip() for part in (names.split(",")[0], summary))
        summary = summary.rstrip(".")
        if re.fullmatch(r"[\w.+-]{1,30}", name) and 10 < len(summary) < 120:
            found.setdefault(name, summary[0].lower() + summary[1:] if summary[1:2].islower() else summary)
    return list(found.items())


def package_summaries(status: Path = Path("/var/lib/dpkg/status")) -> list[tuple[str, str]]:
    """(package, its one-line description) of the installed Debian packages (none where there is no dpkg)."""
    try:
        text = status.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    pairs = re.findall(r"^Package: (\S+)\n(?:[^\n]+\n)*?Description: ([^\n]+)", text, re.M)
    return [(name, desc.strip().rstrip(".")) for name, desc in pairs if 10 < len(desc) < 120]


def varied_instructions(rng: random.Random, limit: int = 20_000) -> list[str]:
    """Up to `limit` distinct chat instructions, the sources taking turns, each source in a seeded order."""
    sources = [
        [t.format(x) for t in _EXPLAIN for x in _TOPICS],
        [t.format(x) for t in _WRITE for x in _SITUATIONS],
        [t.format(x) for t in _CODE for x in _ACTIONS],
        [t.format(*pair) for pair in man_summaries() for t in [rng.choice(_SHELL)]],
        [t.format(*pair) for pair in package_summaries() for t in [rng.choice(_SOFTWARE)]],
    ]
    for source in sources:
        rng.shuffle(source)
    return take_turns(*sources)[:limit]


def take_turns(*lists: list[str]) -> list[str]:
    """The lists' items in turns (first of each, then second of each, ...), each item once, in first place."""
    turns = itertools.chain.from_iterable(itertools.zip_longest(*lists))
    return list(dict.fromkeys(x for x in turns if x is not None))
