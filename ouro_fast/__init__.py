"""ouro_fast: a serving engine for the looped language model Ouro."""
