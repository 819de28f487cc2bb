// dayzero._scheduler: the Python boundary. Plans come out as numpy views of the
// C++ arrays (kept alive by the Plan object); results go in as arrays.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "dayzero/scheduler.h"
#include "dayzero/transitions.h"

namespace py = pybind11;
using namespace dz;

namespace {

template <class T>
py::array view(const std::vector<T>& v, const py::object& owner) {
  return py::array(py::dtype::of<T>(), {static_cast<py::ssize_t>(v.size())}, {static_cast<py::ssize_t>(sizeof(T))},
                   v.data(), owner);
}

template <class T>
using In = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <class T>
std::span<const T> span_of(const In<T>& a) {
  if (a.ndim() != 1) throw SchedulerError("expected a 1-d array");
  return {a.data(), static_cast<std::size_t>(a.shape(0))};
}

const char* const kPhaseNames[] = {"Bootstrapping", "Submitted", "Prefetching", "Prefilling", "PrefillAwaitingResult",
                                   "Decoding",      "Retracted", "Restoring",   "Finishing",  "Finished",
                                   "RemoteFill",    "Ready"};
static_assert(std::size(kPhaseNames) == std::variant_size_v<Phase>);

#define DZ_VIEW(cls, field) \
  def_property_readonly(#field, [](py::object self) { return view(self.cast<const cls&>().field, self); })

}  // namespace

PYBIND11_MODULE(_scheduler, m) {
  m.doc() = "dayzero control plane: request scheduler, paged KV pool, prefix cache";
  py::register_exception<SchedulerError>(m, "SchedulerError", PyExc_ValueError);

  py::enum_<GroupKind>(m, "GroupKind")
      .value("Paged", GroupKind::Paged)
      .value("SlidingWindow", GroupKind::SlidingWindow)
      .value("State", GroupKind::State);
  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::None)
      .value("STOP", FinishReason::Stop)
      .value("LENGTH", FinishReason::Length)
      .value("ABORT", FinishReason::Abort);

  py::class_<CacheGroupSpec>(m, "CacheGroup")
      .def(py::init([](std::string name, GroupKind kind, std::int64_t bytes_per_token, std::int32_t window,
                       std::int64_t state_bytes) {
             return CacheGroupSpec{std::move(name), kind, bytes_per_token, window, state_bytes};
           }),
           py::arg("name"), py::arg("kind") = GroupKind::Paged, py::arg("bytes_per_token") = 0, py::arg("window") = 0,
           py::arg("state_bytes") = 0)
      .def_readonly("name", &CacheGroupSpec::name)
      .def_readonly("kind", &CacheGroupSpec::kind)
      .def_readonly("bytes_per_token", &CacheGroupSpec::bytes_per_token)
      .def_readonly("window", &CacheGroupSpec::window)
      .def_readonly("state_bytes", &CacheGroupSpec::state_bytes);

  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init<>())
      .def_readwrite("block_size", &SchedulerConfig::block_size)
      .def_readwrite("cache_salt_hi", &SchedulerConfig::cache_salt_hi)
      .def_readwrite("cache_salt_lo", &SchedulerConfig::cache_salt_lo)
      .def_readwrite("device_bytes", &SchedulerConfig::device_bytes)
      .def_readwrite("host_bytes", &SchedulerConfig::host_bytes)
      .def_readwrite("max_batch_size", &SchedulerConfig::max_batch_size)
      .def_readwrite("max_tokens_per_step", &SchedulerConfig::max_tokens_per_step)
      .def_readwrite("chunk_size", &SchedulerConfig::chunk_size)
      .def_readwrite("snapshot_slots", &SchedulerConfig::snapshot_slots)
      .def_readwrite("spec_tokens", &SchedulerConfig::spec_tokens)
      .def_readwrite("overlap", &SchedulerConfig::overlap)
      .def_readwrite("prefix_cache", &SchedulerConfig::prefix_cache)
      .def_readwrite("groups", &SchedulerConfig::groups);

  py::class_<CopyOps>(m, "CopyOps")
      .DZ_VIEW(CopyOps, to_host_group)
      .DZ_VIEW(CopyOps, to_host_src)
      .DZ_VIEW(CopyOps, to_host_dst)
      .DZ_VIEW(CopyOps, to_device_group)
      .DZ_VIEW(CopyOps, to_device_src)
      .DZ_VIEW(CopyOps, to_device_dst)
      .DZ_VIEW(CopyOps, state_to_host_slot)
      .DZ_VIEW(CopyOps, state_to_host_pages)
      .DZ_VIEW(CopyOps, state_to_device_slot)
      .DZ_VIEW(CopyOps, state_to_device_pages)
      .DZ_VIEW(CopyOps, restore_src)
      .DZ_VIEW(CopyOps, restore_dst)
      .DZ_VIEW(CopyOps, snapshot_src)
      .DZ_VIEW(CopyOps, snapshot_dst);

  py::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def_readonly("step", &Plan::step)
      .def_property_readonly("rows", &Plan::rows)
      .def_property_readonly("num_input_tokens", &Plan::tokens)
      .DZ_VIEW(Plan, req_ids)
      .DZ_VIEW(Plan, req_slots)
      .DZ_VIEW(Plan, num_tokens)
      .DZ_VIEW(Plan, query_start)
      .DZ_VIEW(Plan, kv_lens)
      .DZ_VIEW(Plan, is_prefill)
      .DZ_VIEW(Plan, sample)
      .DZ_VIEW(Plan, state_slots)
      .DZ_VIEW(Plan, input_ids)
      .DZ_VIEW(Plan, positions)
      .DZ_VIEW(Plan, finished_ids)
      .DZ_VIEW(Plan, finished_reasons)
      .DZ_VIEW(Plan, retracted_ids)
      .DZ_VIEW(Plan, remote_fill_ids)
      .def_property_readonly("copies",
                             [](py::object self) {
                               return py::cast(&self.cast<const Plan&>().copies,
                                               py::return_value_policy::reference_internal, self);
                             })
      .def_property_readonly("block_tables", [](py::object self) {
        const Plan& p = self.cast<const Plan&>();
        py::list out;
        for (std::size_t g = 0; g < p.block_tables.size(); ++g) {
          const auto w = static_cast<py::ssize_t>(p.block_table_width[g]);
          const auto rows = w == 0 ? 0 : static_cast<py::ssize_t>(p.block_tables[g].size()) / w;
          out.append(py::array(py::dtype::of<std::int32_t>(), {rows, w},
                               {static_cast<py::ssize_t>(w * 4), static_cast<py::ssize_t>(4)}, p.block_tables[g].data(),
                               self));
        }
        return out;
      });

  py::class_<Scheduler>(m, "Scheduler")
      .def(py::init<SchedulerConfig>(), py::arg("config"))
      .def(
          "submit",
          [](Scheduler& s, ReqId id, const In<TokenId>& prompt, std::int32_t max_new_tokens,
             std::vector<TokenId> stop_ids, bool ignore_eos, bool remote) {
            s.submit(id, span_of(prompt), SubmitArgs{max_new_tokens, std::move(stop_ids), ignore_eos, remote});
          },
          py::arg("id"), py::arg("prompt"), py::arg("max_new_tokens") = 16,
          py::arg("stop_ids") = std::vector<TokenId>{}, py::arg("ignore_eos") = false, py::arg("remote") = false)
      .def("bootstrap_done", &Scheduler::bootstrap_done, py::arg("id"))
      .def("remote_fill_done", &Scheduler::remote_fill_done, py::arg("id"), py::arg("first_token"))
      .def("abort", &Scheduler::abort, py::arg("id"))
      .def("finish", &Scheduler::finish, py::arg("id"))
      .def("step", [](Scheduler& s) { return std::const_pointer_cast<Plan>(s.step()); })
      .def(
          "feed",
          [](Scheduler& s, const In<ReqId>& ids, const In<std::int32_t>& counts, const In<TokenId>& tokens) {
            s.feed(span_of(ids), span_of(counts), span_of(tokens));
          },
          py::arg("req_ids"), py::arg("counts"), py::arg("tokens"))
      .def("check_invariants", &Scheduler::check_invariants)
      .def("flush_prefix_cache", &Scheduler::flush_prefix_cache)
      .def("discard_inflight", &Scheduler::discard_inflight)
      .def("phase_of", &Scheduler::phase_of, py::arg("id"))
      .def("block_table", &Scheduler::block_table, py::arg("id"), py::arg("group") = 0)
      .def("tokens_of", &Scheduler::tokens_of, py::arg("id"))
      .def("cached_tokens_of", &Scheduler::cached_tokens_of, py::arg("id"))
      .def_property_readonly("capacity", &Scheduler::capacity)
      .def_property_readonly("num_waiting", &Scheduler::waiting)
      .def_property_readonly("num_running", &Scheduler::running)
      .def_property_readonly("num_live", &Scheduler::live)
      .def_property_readonly("plans_in_flight", &Scheduler::plans_in_flight)
      .def("phase_counts",
           [](const Scheduler& s) {
             py::dict d;
             const PhaseCounts c = s.phase_counts();
             for (std::size_t i = 0; i < std::size(kPhaseNames); ++i) d[kPhaseNames[i]] = c.counts[i];
             return d;
           })
      .def(
          "free_blocks", [](const Scheduler& s, std::size_t g) { return s.memory().free_blocks(g); },
          py::arg("group") = 0)
      .def(
          "total_blocks", [](const Scheduler& s, std::size_t g) { return s.memory().total_blocks(g); },
          py::arg("group") = 0)
      .def_property_readonly("free_host_pages", [](const Scheduler& s) { return s.memory().free_host_pages(); })
      .def("prefix_stats",
           [](const Scheduler& s) {
             const auto& c = s.memory().cache();
             py::dict d;
             d["entries"] = c.size();
             d["device_entries"] = c.device_entries();
             d["evictable"] = c.evictable();
             d["host_entries"] = c.host_entries();
             d["snapshots"] = c.snapshots_held();
             d["lookup_tokens"] = c.lookup_tokens();
             d["hit_tokens"] = c.hit_tokens();
             return d;
           })
      .def_property_readonly("layout", [](const Scheduler& s) {
        const MemoryLayout& l = s.layout();
        py::dict d;
        d["page_bytes"] = l.page_bytes;
        d["num_pages"] = l.num_pages;
        d["state_slot_bytes"] = l.state_slot_bytes;
        d["num_slots"] = l.num_slots;
        d["num_host_pages"] = l.num_host_pages;
        d["pages_per_state"] = l.pages_per_state;
        d["blocks_per_page"] = l.blocks_per_page;
        d["padded_row_bytes"] = l.padded_row_bytes;
        return d;
      });
}
