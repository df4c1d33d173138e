// The statistics document. See stats_document.h.
#include "runtime/stats_document.h"

#include <string_view>

#include "stats/json_writer.h"

namespace vramswap {
namespace {

// The counters, in the order vramswap.h lists them: each one's key and where it is kept.
// Everything that sums or writes them walks this one list.
struct Counter {
  std::string_view key;
  uint64_t& (*in)(DeviceStats&);
};
#define VRAMSWAP_POOL_COUNTER(key, field) \
  Counter { key, [](DeviceStats& d) -> uint64_t& { return d.pool.field; } }
#define VRAMSWAP_ENGINE_COUNTER(field) \
  Counter { #field, [](DeviceStats& d) -> uint64_t& { return d.engine.field; } }
const Counter kCounters[] = {
    VRAMSWAP_POOL_COUNTER("allocated_bytes", allocated_bytes),
    VRAMSWAP_POOL_COUNTER("reserved_bytes", reserved_bytes),
    VRAMSWAP_POOL_COUNTER("peak_allocated_bytes", peak_allocated_bytes),
    VRAMSWAP_POOL_COUNTER("peak_reserved_bytes", peak_reserved_bytes),
    VRAMSWAP_POOL_COUNTER("device_limit_bytes", limit_bytes),
    VRAMSWAP_POOL_COUNTER("num_allocs", num_allocs),
    VRAMSWAP_POOL_COUNTER("num_frees", num_frees),
    VRAMSWAP_POOL_COUNTER("num_cache_hits", num_cache_hits),
    VRAMSWAP_POOL_COUNTER("num_ooms", num_ooms),
    VRAMSWAP_ENGINE_COUNTER(resident_bytes),
    VRAMSWAP_ENGINE_COUNTER(peak_resident_bytes),
    VRAMSWAP_ENGINE_COUNTER(tagged_bytes),
    VRAMSWAP_ENGINE_COUNTER(evictable_bytes),
    VRAMSWAP_ENGINE_COUNTER(clean_bytes),
    VRAMSWAP_ENGINE_COUNTER(evicted_bytes),
    VRAMSWAP_ENGINE_COUNTER(in_flight_bytes),
    VRAMSWAP_ENGINE_COUNTER(host_bytes),
    VRAMSWAP_ENGINE_COUNTER(peak_host_bytes),
    VRAMSWAP_ENGINE_COUNTER(bytes_evicted_total),
    VRAMSWAP_ENGINE_COUNTER(bytes_prefetched_total),
    VRAMSWAP_ENGINE_COUNTER(num_evictions),
    VRAMSWAP_ENGINE_COUNTER(num_prefetches),
    VRAMSWAP_ENGINE_COUNTER(num_faults),
    VRAMSWAP_ENGINE_COUNTER(num_late_prefetches),
    VRAMSWAP_ENGINE_COUNTER(num_clean_reuses),
    VRAMSWAP_ENGINE_COUNTER(num_verify_failures),
    VRAMSWAP_ENGINE_COUNTER(tagged_waste_bytes),
    VRAMSWAP_ENGINE_COUNTER(peak_tagged_waste_bytes),
    VRAMSWAP_ENGINE_COUNTER(num_tracked_blocks),
    VRAMSWAP_ENGINE_COUNTER(num_planned_steps),
    VRAMSWAP_ENGINE_COUNTER(num_plan_divergences),
    VRAMSWAP_ENGINE_COUNTER(num_plan_backoffs),
    VRAMSWAP_ENGINE_COUNTER(num_plan_fetch_moves),
    VRAMSWAP_ENGINE_COUNTER(num_plan_fetch_moves_undone),
    VRAMSWAP_ENGINE_COUNTER(planned_bytes_d2h),
    VRAMSWAP_ENGINE_COUNTER(disk_bytes),
    VRAMSWAP_ENGINE_COUNTER(disk_bytes_written),
    VRAMSWAP_ENGINE_COUNTER(disk_bytes_read),
    VRAMSWAP_ENGINE_COUNTER(disk_bytes_read_ahead),
    VRAMSWAP_ENGINE_COUNTER(disk_bytes_written_ahead),
    VRAMSWAP_ENGINE_COUNTER(disk_bytes_bounced),
    VRAMSWAP_ENGINE_COUNTER(kept_bytes),
    VRAMSWAP_ENGINE_COUNTER(frozen_bytes_d2h),
    VRAMSWAP_ENGINE_COUNTER(frozen_bytes_dropped),
};
#undef VRAMSWAP_POOL_COUNTER
#undef VRAMSWAP_ENGINE_COUNTER

// Adds every counter of `d` to `sum` (the totals: the peaks are sums of each device's peak).
void add(DeviceStats& sum, DeviceStats d) {
  for (const Counter& c : kCounters) c.in(sum) += c.in(d);
}

// The members shared by the totals and each device's object, in the documented order.
void write_counters(stats::JsonWriter& json, DeviceStats d) {
  for (const Counter& c : kCounters) json.field(c.key, c.in(d));
}

}  // namespace

std::string stats_document(const std::vector<DeviceStats>& devices, uint64_t num_invalid_frees,
                           const cuda::HostTimes& host_times) {
  DeviceStats total;
  for (const DeviceStats& d : devices) add(total, d);
  stats::JsonWriter json;
  json.begin_object();
  write_counters(json, total);
  json.field("num_invalid_frees", num_invalid_frees);
  json.field("host_wait_ns", host_times.wait_ns);
  json.field("host_vmm_ns", host_times.vmm_ns);
  json.field("host_pin_ns", host_times.pin_ns);
  json.field("host_vmm_mapped_bytes", host_times.vmm_mapped_bytes);
  json.field("host_vmm_unmapped_bytes", host_times.vmm_unmapped_bytes);
  json.field("host_vmm_created_bytes", host_times.vmm_created_bytes);
  json.field("host_vmm_released_bytes", host_times.vmm_released_bytes);
  json.field("host_vmm_map_calls", host_times.vmm_map_calls);
  json.field("host_vmm_unmap_calls", host_times.vmm_unmap_calls);
  json.field("host_vmm_create_calls", host_times.vmm_create_calls);
  json.field("host_vmm_release_calls", host_times.vmm_release_calls);
  json.begin_array("devices");
  for (const DeviceStats& d : devices) {
    json.begin_object().field("device", d.device);
    write_counters(json, d);
    json.field("num_free_blocks", d.pool.num_free_blocks).field("va_reserved_bytes", d.pool.va_reserved_bytes).end_object();
  }
  json.end_array().end_object();
  return json.str();
}

}  // namespace vramswap
