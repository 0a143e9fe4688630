// One connection: reads a request (header first, so the body's size is checked against the
// shared budget before it is read), routes it, writes the answer or streams a job's events.
#pragma once

#include <memory>

#include <boost/asio/local/stream_protocol.hpp>

#include "supervisor/api/server.h"

namespace assay::supervisor::api {

// Starts serving `socket` for `peer`; the session keeps itself alive until the connection ends.
void start_session(boost::asio::local::stream_protocol::socket socket, Service& service,
                   const Peer& peer, std::shared_ptr<Budget> budget);

}  // namespace assay::supervisor::api
