"""The worlds and benchmarks a run reads: the prompt templates and prompt sets (prompts.py), the
paper's benchmarks and MATH training set in their real formats (benchmarks.py), and the embedded
worlds with their generators (tinymath/, zipf/, countdown/)."""
