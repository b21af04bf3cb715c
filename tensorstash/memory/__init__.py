"""What the process really holds and how it gives memory back: real-memory probes
(_memory), trimming the heap (_trim), and the session pool (_pool, _alloc.cpp)."""
