"""llama.cpp's own C++ server, `llama-server`, as a fast-tier engine the worker runs."""
