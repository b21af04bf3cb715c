"""Where a saved tensor can go: host RAM (cpu); lz4 (compress, and the codec: _codec
and the modules it names); disk (disk; its spill file, extents and raw I/O _spillfile;
what a session's spills share _spillwork; its spill directory _spilldir and read
buffers _buffers); and recompute; and policies by name (_names)."""
