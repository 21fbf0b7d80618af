"""The campaign's books: coverage of the planned cells, reruns, and the claim map."""
