// elastic.ring._native: the Python face of the core. Arrays arrive through DLPack (torch
// tensors incl. bfloat16, numpy arrays) without copies; the GIL is released while
// anything blocks; CommError becomes RingFailure, which elastic.ring.errors turns into the elastic exception.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <limits>
#include <utility>
#include <memory>
#include <mutex>

#include "algorithm.h"
#include "communicator.h"
#include "executor.h"
#include "reduce.h"
#include "transport/auth.h"
#include "transport/listener.h"

namespace nb = nanobind;
using namespace ering;

namespace {

using Array = nb::ndarray<nb::device::cpu>;

struct Buffer {
  void* ptr;
  size_t count;
  DType dtype;
};

DType to_dtype(const nb::dlpack::dtype& t) {
  using Code = nb::dlpack::dtype_code;
  if (t.lanes == 1) {
    if (t.code == uint8_t(Code::Float) && t.bits == 16) return DType::Float16;
    if (t.code == uint8_t(Code::Bfloat) && t.bits == 16) return DType::BFloat16;
    if (t.code == uint8_t(Code::Float) && t.bits == 32) return DType::Float32;
    if (t.code == uint8_t(Code::Float) && t.bits == 64) return DType::Float64;
    if (t.code == uint8_t(Code::Int) && t.bits == 32) return DType::Int32;
    if (t.code == uint8_t(Code::Int) && t.bits == 64) return DType::Int64;
    if (t.code == uint8_t(Code::UInt) && t.bits == 8) return DType::UInt8;
  }
  throw nb::type_error(("unsupported dtype (code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
                        " bits); supported: float16, bfloat16, float32, float64, int32, int64, uint8").c_str());
}

Buffer to_buffer(const Array& a, const char* what) {
  // C-contiguous check: strides (in elements) must be those of a dense row-major array.
  int64_t expect = 1;
  for (size_t i = a.ndim(); a.size() > 0 && i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      throw nb::value_error((std::string(what) + ": tensor must be contiguous (call .contiguous() first)").c_str());
    expect *= int64_t(a.shape(i));
  }
  return {a.data(), a.size(), to_dtype(a.dtype())};
}

ReduceOp to_op(int op) {
  if (op < 0 || op > 3) throw nb::value_error(("unknown reduce op " + std::to_string(op)).c_str());
  return ReduceOp(op);
}

struct PyListener {
  std::mutex mu;
  std::shared_ptr<Listener> impl;
  std::shared_ptr<Listener> get() {
    std::lock_guard<std::mutex> g(mu);
    if (!impl) throw nb::value_error("listener is closed");
    return impl;
  }
  void close() {
    std::shared_ptr<Listener> l;
    {
      std::lock_guard<std::mutex> g(mu);
      l = std::move(impl);
    }
  }
};

// A communicator plus its executor. Every method takes shared_ptr snapshots under mu, so
// close() from one thread never frees what abort() or a collective in another thread is
// still using: the last snapshot to go frees it.
struct PyComm {
  std::mutex mu;
  std::shared_ptr<Listener> listener;
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Executor> exec;

  std::shared_ptr<Communicator> c() {
    std::lock_guard<std::mutex> g(mu);
    if (!comm) throw CommError(ErrorKind::Invalid, "communicator is closed");
    return comm;
  }
  std::shared_ptr<Executor> e() {
    std::lock_guard<std::mutex> g(mu);
    if (!exec) {
      if (!comm) throw CommError(ErrorKind::Aborted, "communicator is closed");
      throw CommError(ErrorKind::Invalid, "communicator is not formed");
    }
    return exec;
  }
  void close() {
    std::shared_ptr<Communicator> c;
    std::shared_ptr<Executor> e;
    {
      std::lock_guard<std::mutex> g(mu);
      c = std::move(comm);
      e = std::move(exec);
      listener.reset();
    }
    if (c) c->abort("communicator closed");
    if (e) e->stop();
  }
  ~PyComm() { close(); }
};

// The world digest a communicator is given: exactly 32 bytes (see transport/handshake.h).
WorldDigest to_world_digest(const nb::bytes& digest) {
  WorldDigest d{};
  if (digest.size() != d.size())
    throw nb::value_error(("digest: got " + std::to_string(digest.size()) + " bytes, want " +
                           std::to_string(d.size()) + " (a SHA-256 naming the world)").c_str());
  std::memcpy(d.data(), digest.c_str(), d.size());
  return d;
}

// The communicator of `view`, made before any PyComm holds it (a bad world throws first).
std::pair<std::shared_ptr<Listener>, std::shared_ptr<Communicator>> make_comm(
    PyListener* listener, const std::string& job_id, const nb::bytes& secret, uint64_t world_version, int rank,
    RingView view, const CommConfig& config) {
  std::shared_ptr<Listener> l = listener ? listener->get() : nullptr;
  auto comm = std::make_shared<Communicator>(l.get(), job_id, std::string(secret.c_str(), secret.size()),
                                             world_version, rank, std::move(view), config);
  return {std::move(l), std::move(comm)};
}


}  // namespace

NB_MODULE(_native, m) {
  // Communicators held by module globals (the runtime, an optimizer) may still exist when
  // the interpreter exits; that is expected, not a reference leak worth a screenful.
  nb::set_leak_warnings(false);
  m.doc() = "elastic-ring native core: ring collectives over TCP and same-host shared memory, with deadlines, abort and authenticated handshakes";

  // The one list in common.h, so Python names the kinds without mirroring their numbers.
  nb::enum_<ErrorKind> kinds(m, "ErrorKind", "Why a ring operation failed (ering::ErrorKind); carried as .kind "
                                             "on the elastic exceptions.");
#define ERING_KIND_BINDING(name, number, doc) kinds.value(#name, ErrorKind::name, doc);
  ERING_ERROR_KINDS(ERING_KIND_BINDING)
#undef ERING_KIND_BINDING

  // A failed ring operation reaches Python as RingFailure(kind, message, op, world_version,
  // rank, peer, call), call being (seq, tag, description) of the collective that failed or
  // None; elastic.ring.errors makes the exception the caller sees of it. The core imports
  // no Python module: what a failure means to the runtime is decided there, on its kind.
  // A plain pointer, never released: a static nb::object would be destroyed after the interpreter.
  static PyObject* ring_failure = PyErr_NewExceptionWithDoc(
      "elastic.ring._native.RingFailure",
      "A ring operation failed: args are (kind, message, op, world_version, rank, peer, call).", nullptr, nullptr);
  m.attr("RingFailure") = nb::borrow(ring_failure);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const CommError& e) {
      if (e.kind == ErrorKind::Invalid) {
        PyErr_SetString(PyExc_ValueError, e.what());
        return;
      }
      try {
        nb::object call = e.call_seq < 0 ? nb::none()
                                         : nb::object(nb::make_tuple(e.call_seq, e.call_tag, nb::str(e.call.c_str())));
        nb::object failure = nb::handle(ring_failure)(nb::cast(e.kind), nb::str(e.what()), nb::str(e.op.c_str()),
                                                      e.world_version, e.rank, e.peer, call);
        PyErr_SetObject(ring_failure, failure.ptr());
      } catch (nb::python_error& pe) {
        pe.restore();
      }
    }
  });

  nb::class_<PyListener>(m, "Listener",
                         "Listening socket for ring connections; open it before rendezvous and announce .address.")
      .def("__init__",
           [](PyListener* self, const std::string& host, int port, double handshake_timeout) {
             auto l = std::make_shared<Listener>(host, port, handshake_timeout);
             new (self) PyListener();
             self->impl = std::move(l);
           },
           nb::arg("host") = "127.0.0.1", nb::arg("port") = 0, nb::arg("handshake_timeout") = 5.0)
      .def_prop_ro("address", [](PyListener& l) { return l.get()->address(); })
      .def_prop_ro("port", [](PyListener& l) { return l.get()->port(); })
      .def_prop_ro("refusal_count", [](PyListener& l) { return l.get()->refusal_count(); })
      .def("refusals", [](PyListener& l) { return l.get()->refusals(); },
           "Recent refused connection attempts, oldest first.")
      .def("close", &PyListener::close, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<Work>(m, "Work").def("done", &Work::done, nb::call_guard<nb::gil_scoped_release>());

  // The settings struct itself, so its defaults are written once (config.h) and Python
  // fills it by field name. Sizes are Python ints that must not be negative; the enum
  // settings are their names; check() applies the rest of the rules.
  nb::class_<CommConfig> config(m, "CommConfig",
                                "Ring settings with the core's defaults (ering::CommConfig); elastic.CommConfig "
                                "fills one by field name.");
  config.def(nb::init<>())
      .def_rw("timeout", &CommConfig::timeout, "Seconds a rank may stay in one collective before it fails (Timeout).")
      .def_rw("form_timeout", &CommConfig::form_timeout, "Seconds form() waits for both ring neighbours.")
      .def_rw("dead_link_timeout", &CommConfig::dead_link_timeout,
              "Seconds a ring connection may go unacknowledged before the kernel fails it (a dead link).");
  auto size_setting = [&config](const char* name, size_t CommConfig::*field, const char* doc) {
    config.def_prop_rw(
        name, [field](const CommConfig& c) { return uint64_t(c.*field); },
        [field, name](CommConfig& c, int64_t v) {
          if (v < 0)
            throw CommError(ErrorKind::Invalid,
                            "CommConfig." + std::string(name) + " must not be negative, got " + std::to_string(v));
          c.*field = size_t(v);
        },
        doc);
  };
  size_setting("segment_bytes", &CommConfig::segment_bytes, "Pipeline segment size in bytes.");
  size_setting("small_bytes", &CommConfig::small_bytes, "Allreduce up to this size takes the small-message path.");
  size_setting("fusion_bytes", &CommConfig::fusion_bytes, "Async allreduces are fused into buckets up to this size.");
  size_setting("hierarchical_bytes", &CommConfig::hierarchical_bytes,
               "algorithm 'auto' takes the hierarchical path above this size.");
  config
      .def_prop_rw(
          "transport", [](const CommConfig& c) { return std::string(transport_name(c.transport)); },
          [](CommConfig& c, const std::string& v) { c.transport = parse_transport(v); },
          "'auto' (shared memory between ranks of one host) or 'tcp'.")
      .def_prop_rw(
          "algorithm", [](const CommConfig& c) { return std::string(algorithm_setting_name(c.algorithm)); },
          [](CommConfig& c, const std::string& v) { c.algorithm = parse_algorithm_setting(v); },
          "Allreduce algorithm: 'auto', 'ring' or 'hierarchical'.")
      .def("check", [](const CommConfig& c) { check_config(c); },
           "Raises ValueError naming the first setting that is out of range.");

  // The allreduce algorithm as a type, and its choice as the pure function it is, so a table
  // test can read the rules without forming a world.
  nb::enum_<Algorithm>(m, "Algorithm", "Which algorithm an allreduce runs (ering::Algorithm).")
      .value("Ring", Algorithm::Ring)
      .value("SmallMessage", Algorithm::SmallMessage)
      .value("Hierarchical", Algorithm::Hierarchical);
  m.def("algorithm_name", [](Algorithm a) { return std::string(algorithm_name(a)); }, nb::arg("algorithm"),
        "What Communicator.algorithm_for reports for this algorithm: 'ring' or 'hierarchical'.");
  m.def("choose_allreduce",
        [](uint64_t nbytes, const CommConfig& config, const std::vector<std::string>& hosts, int rank) {
          if (!hosts.empty() && (rank < 0 || size_t(rank) >= hosts.size()))
            throw nb::value_error(("rank " + std::to_string(rank) + " has no entry in hosts (" +
                                   std::to_string(hosts.size()) + " of them)").c_str());
          return choose_allreduce(nbytes, config, plan_hierarchy(host_layout(hosts, rank), config.algorithm));
        },
        nb::arg("nbytes"), nb::arg("config"), nb::arg("hosts"), nb::arg("rank"),
        "The algorithm an allreduce of nbytes gets on `rank` of a world on `hosts` (one name per rank, or "
        "empty): the communicator's own choice, without forming one.");

  nb::class_<PyComm>(m, "Communicator")
      .def("__init__",
           [](PyComm* self, PyListener* listener, const std::string& job_id, nb::bytes secret, uint64_t world_version,
              int rank, std::vector<std::string> peers, const CommConfig& config, std::vector<std::string> hosts,
              nb::bytes digest) {
             auto [l, comm] = make_comm(listener, job_id, secret, world_version, rank,
                                        full_view(peers, hosts, rank, to_world_digest(digest)), config);
             auto* pc = new (self) PyComm();
             pc->listener = std::move(l);
             pc->comm = std::move(comm);
           },
           nb::arg("listener").none(), nb::arg("job_id"), nb::arg("secret"), nb::arg("world_version"), nb::arg("rank"),
           nb::arg("peers"), nb::arg("config") = CommConfig(), nb::arg("hosts") = std::vector<std::string>{},
           nb::arg("digest") = nb::bytes(std::string(kWorldDigestBytes, '\0').data(), kWorldDigestBytes),
           "A communicator of a world given in full: every rank's address (and host), in rank order. "
           "elastic.Communicator.create passes the digest of that list (ring_view.list_digest); all zero "
           "bytes otherwise, which only another communicator made this way matches.")
      .def_static(
          "from_view",
          [](PyListener* listener, const std::string& job_id, nb::bytes secret, uint64_t world_version, int rank,
             int size, std::vector<int> ranks, std::vector<std::string> addresses, std::vector<std::string> hosts,
             std::vector<int> layout, const CommConfig& config, nb::bytes digest) {
            // layout: [] (no hosts) or [num_hosts, host, local_rank, local_size, first, prev_leader,
            // next_leader, largest_host]
            if (addresses.size() != ranks.size() || (!hosts.empty() && hosts.size() != ranks.size()))
              throw nb::value_error("from_view: ranks, addresses and hosts (if given) must have the same length");
            if (!layout.empty() && layout.size() != 8) throw nb::value_error("from_view: layout has 8 numbers or none");
            RingView v;
            v.size = size;
            for (size_t i = 0; i < ranks.size(); ++i) {
              v.addresses[ranks[i]] = addresses[i];
              if (!hosts.empty()) v.hosts[ranks[i]] = hosts[i];
            }
            if (!layout.empty()) {
              HostLayout& l = v.layout;
              l.known = true;
              l.num_hosts = layout[0], l.host = layout[1], l.local_rank = layout[2], l.local_size = layout[3];
              l.first = layout[4], l.prev_leader = layout[5], l.next_leader = layout[6], l.largest_host = layout[7];
            }
            v.digest = to_world_digest(digest);
            auto [l, comm] = make_comm(listener, job_id, secret, world_version, rank, std::move(v), config);
            auto* pc = new PyComm();
            pc->listener = std::move(l);
            pc->comm = std::move(comm);
            return pc;
          },
          nb::arg("listener").none(), nb::arg("job_id"), nb::arg("secret"), nb::arg("world_version"), nb::arg("rank"),
          nb::arg("size"), nb::arg("ranks"), nb::arg("addresses"), nb::arg("hosts"), nb::arg("layout"),
          nb::arg("config"), nb::arg("digest"), nb::rv_policy::take_ownership,
          "A communicator of a world this rank knows by its view: the ranks it connects to and its host's layout.")
      .def("form",
           [](PyComm& s) {
             auto c = s.c();
             c->form();
             auto e = std::make_shared<Executor>(c, c->config().fusion_bytes);
             std::lock_guard<std::mutex> g(s.mu);
             if (!s.comm) {  // closed while forming
               e->stop();
               throw CommError(ErrorKind::Aborted, "communicator closed while forming", "form");
             }
             s.exec = std::move(e);
           },
           nb::call_guard<nb::gil_scoped_release>())
      .def("abort",
           [](PyComm& s, const std::string& reason) {
             std::shared_ptr<Communicator> c;
             {
               std::lock_guard<std::mutex> g(s.mu);
               c = s.comm;
             }
             if (c) c->abort(reason);
           },
           nb::arg("reason") = "", nb::call_guard<nb::gil_scoped_release>())
      .def("close", &PyComm::close, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("rank", [](PyComm& s) { return s.c()->rank(); })
      .def_prop_ro("size", [](PyComm& s) { return s.c()->size(); })
      .def_prop_ro("world_version", [](PyComm& s) { return s.c()->world_version(); })
      .def_prop_ro("ops_run", [](PyComm& s) { return s.c()->ops_run(); })
      .def_prop_ro("link_kinds", [](PyComm& s) { return s.c()->link_kinds(); },
                   "How the links run: [to the next rank, from the previous one], each 'tcp' or 'shm'.")
      .def_prop_ro("hierarchical_link_kinds", [](PyComm& s) { return s.c()->hierarchical_link_kinds(); },
                   "How the hierarchical path's rings run: [[local send, recv], [leaders send, recv]], "
                   "each pair empty when this rank is in no such ring.")
      .def_prop_ro("hierarchy",
                   [](PyComm& s) {
                     auto c = s.c();
                     const Hierarchy& h = c->hierarchy();
                     nb::dict d;
                     d["applies"] = h.applies;
                     d["why_not"] = h.why_not;
                     if (h.applies) {
                       d["num_hosts"] = h.num_hosts;
                       d["host"] = h.host;
                       d["local_rank"] = h.local_rank;
                       d["local_size"] = h.local_size;
                       d["leader"] = h.leader();
                       d["prev_leader"] = h.prev_leader;
                       d["next_leader"] = h.next_leader;
                     }
                     return d;
                   })
      .def("algorithm_for", [](PyComm& s, size_t nbytes) { return std::string(algorithm_name(s.c()->algorithm_for(nbytes))); },
           nb::arg("nbytes"), "What allreduce runs for a buffer of this many bytes: 'ring' or 'hierarchical'.")
      .def_prop_ro("failed",
                   [](PyComm& s) {
                     std::lock_guard<std::mutex> g(s.mu);
                     return !s.comm || s.comm->failed();
                   })
      .def("allreduce_",
           [](PyComm& s, Array a, int op) {
             Buffer b = to_buffer(a, "allreduce");
             ReduceOp rop = to_op(op);
             nb::gil_scoped_release nogil;
             auto c = s.c();
             s.e()->run([&] { c->allreduce(b.ptr, b.count, b.dtype, rop); });
           },
           nb::arg("array").noconvert(), nb::arg("op"))
      .def("allreduce_async_",
           [](PyComm& s, Array a, int op) {
             Buffer b = to_buffer(a, "allreduce_async_");
             ReduceOp rop = to_op(op);
             nb::gil_scoped_release nogil;
             return s.e()->allreduce_async(b.ptr, b.count, b.dtype, rop);
           },
           nb::arg("array").noconvert(), nb::arg("op"))
      .def("wait",
           [](PyComm& s, std::shared_ptr<Work> w) {
             std::shared_ptr<Executor> e;
             {
               std::lock_guard<std::mutex> g(s.mu);
               e = s.exec;
             }
             // After close() every submitted Work has finished (the executor drains its
             // queue on a dead ring), so its own error is the answer.
             if (e) e->wait(w);
             else w->wait();
           },
           nb::arg("work"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("flush", [](PyComm& s) { s.e()->flush(); }, nb::call_guard<nb::gil_scoped_release>())
      .def("broadcast_",
           [](PyComm& s, Array a, int root) {
             Buffer b = to_buffer(a, "broadcast_");
             size_t bytes = b.count * dtype_size(b.dtype);
             nb::gil_scoped_release nogil;
             auto c = s.c();
             s.e()->run([&] { c->broadcast(b.ptr, bytes, root); });
           },
           nb::arg("array").noconvert(), nb::arg("root"))
      .def("allgather_",
           [](PyComm& s, Array in, Array out, std::vector<uint64_t> bytes_per_rank) {
             Buffer bi = to_buffer(in, "allgather input");
             Buffer bo = to_buffer(out, "allgather output");
             uint64_t total = 0;
             for (auto v : bytes_per_rank) {
               // Sizes may come from peers' counts: a sum that wraps must not pass for the output's.
               if (v > std::numeric_limits<uint64_t>::max() - total)
                 throw nb::value_error("allgather: the per-rank sizes add up to 2**64 bytes or more");
               total += v;
             }
             if (total != bo.count * dtype_size(bo.dtype))
               throw nb::value_error("allgather: output size does not match the sum of per-rank sizes");
             nb::gil_scoped_release nogil;
             auto c = s.c();
             if (bytes_per_rank.size() == size_t(c->size()) && bi.count * dtype_size(bi.dtype) != bytes_per_rank[c->rank()])
               throw CommError(ErrorKind::Invalid, "allgather: input size does not match this rank's entry");
             s.e()->run([&] { c->allgather(bi.ptr, bo.ptr, bytes_per_rank); });
           },
           nb::arg("input").noconvert(), nb::arg("output").noconvert(), nb::arg("bytes_per_rank"))
      .def("reduce_scatter_",
           [](PyComm& s, Array in, Array out, std::vector<uint64_t> counts, int op) {
             Buffer bi = to_buffer(in, "reduce_scatter input");
             Buffer bo = to_buffer(out, "reduce_scatter output");
             ReduceOp rop = to_op(op);
             if (bi.dtype != bo.dtype) throw nb::value_error("reduce_scatter: input and output dtypes differ");
             uint64_t total = 0;
             for (auto v : counts) {
               if (v > bi.count) throw nb::value_error("reduce_scatter: a per-rank count exceeds the input");
               total += v;
             }
             if (total != bi.count)
               throw nb::value_error("reduce_scatter: the input does not hold the sum of the per-rank counts");
             nb::gil_scoped_release nogil;
             auto c = s.c();
             if (counts.size() == size_t(c->size()) && bo.count != counts[c->rank()])
               throw CommError(ErrorKind::Invalid, "reduce_scatter: the output does not hold this rank's count");
             s.e()->run([&] { c->reduce_scatter(bi.ptr, bo.ptr, counts, bi.dtype, rop); });
           },
           nb::arg("input").noconvert(), nb::arg("output").noconvert(), nb::arg("counts"), nb::arg("op"))
      .def("shift_",
           [](PyComm& s, Array in, Array out, bool backward) {
             Buffer bi = to_buffer(in, "shift input");
             Buffer bo = to_buffer(out, "shift output");
             size_t sb = bi.count * dtype_size(bi.dtype), rb = bo.count * dtype_size(bo.dtype);
             const char *si = static_cast<const char*>(bi.ptr), *ro = static_cast<const char*>(bo.ptr);
             if (sb && rb && si < ro + rb && ro < si + sb)
               throw nb::value_error("shift: the input and the output overlap");
             nb::gil_scoped_release nogil;
             auto c = s.c();
             if (backward) s.e()->run([&] { c->shift_back(bi.ptr, sb, bo.ptr, rb); });
             else s.e()->run([&] { c->shift(bi.ptr, sb, bo.ptr, rb); });
           },
           nb::arg("input").noconvert(), nb::arg("output").noconvert(), nb::arg("backward") = false)
      .def("barrier",
           [](PyComm& s) {
             auto c = s.c();
             s.e()->run([c] { c->barrier(); });
           },
           nb::call_guard<nb::gil_scoped_release>());

  m.def("hmac_sha256",
        [](nb::bytes key, nb::bytes data) {
          Digest d = hmac_sha256(std::string(key.c_str(), key.size()), data.c_str(), data.size());
          return nb::bytes(reinterpret_cast<const char*>(d.data()), d.size());
        },
        "HMAC-SHA256 as used by the ring handshake (exposed for tests).");
}
