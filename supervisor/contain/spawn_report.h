// The parent's side of the child's pipes (spawn_report.cpp), for spawn.cpp.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "supervisor/contain/child.h"

namespace assay::contain::detail {

// Interface names in /proc/net/dev text (two header lines, then "  name: counters...").
std::vector<std::string> interfaces_of(const std::string& net_dev);

// Whether the namespace at `mine_path` is the one (dev, ino) names (ino 0: unknown: taken as so).
bool same_namespace(const char* mine_path, std::uint64_t dev, std::uint64_t ino);

// What the gate pipe carries: a header, then the files the child writes `0` to.
std::string gate_message(const std::vector<std::string>& attach_files);

// Writes the gate message; false (and `write_errno`) when the child is gone.
bool write_gate(int fd, const std::string& gate, int& write_errno);

// What the worker holds that it must not (empty: nothing).
std::string kept_privileges(const PrivilegesReport& held, bool root_worker);

}  // namespace assay::contain::detail
