// The extension's functions for Python. `attend` lets go of the GIL while it runs: a long prompt's attention
// takes a while, and the server's other threads go on meanwhile. The SAT update's calls are too short to pay for it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sat_update", &sat_update, "adds the SAT rows' low-rank update into a projection's output (sat_update.cpp)");
  m.def("attend", &attend, py::call_guard<py::gil_scoped_release>(),
        "every row of a pass over exactly its keys (attend.cpp)");
  m.def("linear", &linear, py::call_guard<py::gil_scoped_release>(),
        "x W^T with each output's sum in one fixed order for any number of rows (linear.cpp)");
  m.def("head_score", &head_score, "one draft's candidate scores from the sampler head (head_score.cpp)");
  m.def("applies", &applies, "whether attend takes a model with these heads and head size");
}
