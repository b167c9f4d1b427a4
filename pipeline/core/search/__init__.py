"""Neighbour search: FAISS shards (knn), the search interface (neighbours), the exact reference
(exact), what FAISS can do on GPU (faiss_gpu, index_factory). No Ray."""
